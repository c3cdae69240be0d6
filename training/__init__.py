"""Training with Lightning: the LightningModule, callbacks, loggers and `train(cfg, run_dir)`."""
