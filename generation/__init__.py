"""Everything between a trained network and text: the decoding loop with its KV-cache prefill, sliding
window and stop tokens (decode), the CUDA-graph step for GPUs (step), sampling (sampling), the session
that encodes prompts for generate.py and the training-time samples alike (session), streaming text
(text) and attention pictures (attention_plot).

    from generation import generate, load_checkpoint, stream

`load_checkpoint` lives in the top-level `checkpoint.py`; it is here so that one import gives a model
and the functions that decode with it.
"""

from checkpoint import load_checkpoint
from generation.decode import generate, stream

__all__ = ["generate", "load_checkpoint", "stream"]
