"""Everything between a trained network and text: reading checkpoints (checkpoint), the decoding loop
with its KV-cache prefill, sliding window and stop tokens (decode), the one-token step (step),
sampling (sampling), the session that encodes prompts for generate.py and the training-time samples
alike (session), streaming text (text), attention pictures (attention_plot), and the command-line and
output plumbing the scripts share (cli, output)."""
