"""The Hydra sweeper behind `python train.py -m hparams_search=optuna` (optuna_sweeper.py)."""
