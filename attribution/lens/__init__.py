"""Read a language model's residual stream in vocabulary space: the logit lens and direct logit attribution.

Both find the decoder layers, the final norm and the unembedding of HuggingFace causal LMs themselves (Llama,
Qwen2/3, Mistral, Gemma, Phi, GPT-2, GPT-NeoX, by :func:`lm_layout`); ``layout=lm_layout(model, final_norm=...)``
names them for other models.
"""

from ..models import LMLayout, lm_layout
from .dla import DirectLogitAttribution, direct_logit_attribution
from .logit_lens import logit_lens, top_tokens
from .plot import plot_direct_logit_attribution, plot_logit_lens

__all__ = [
    "DirectLogitAttribution",
    "LMLayout",
    "direct_logit_attribution",
    "lm_layout",
    "logit_lens",
    "plot_direct_logit_attribution",
    "plot_logit_lens",
    "top_tokens",
]
