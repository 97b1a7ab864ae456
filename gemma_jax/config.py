"""The one config schema: every field, its default and its meaning.

`default_config()` returns a locked `ml_collections.ConfigDict`; assigning a field
that does not exist raises, so a misspelt override is an error and never a silent
default. `validate(config)` checks consistency before anything is traced or compiled
and raises `ConfigError` naming the offending field.
"""

from ml_collections import config_dict

from gemma_jax import remat
from gemma_jax.layers.mlp import ACTIVATIONS

ATTENTION_TYPES = ("local", "global")
BLOCK_TYPES = ("gemma3",)
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
  """A config field holds a value the model cannot be built with."""

  def __init__(self, field, message):
    super().__init__(f"config.{field}: {message}")
    self.field = field


def model_config() -> config_dict.ConfigDict:
  """The architecture of one decoder-only model."""
  c = config_dict.ConfigDict()
  c.name = "custom"                       # preset name, informational
  c.block_type = "gemma3"                 # layer family, one of BLOCK_TYPES
  c.vocab_size = 262144                   # V
  c.d_model = 1152                        # D, residual width
  c.num_layers = 26                       # decoder layers
  c.num_heads = 4                         # N, query heads
  c.num_kv_heads = 1                      # K, key/value heads (N % K == 0)
  c.head_dim = 256                        # H
  c.mlp_dim = 6912                        # F, hidden width of the gated MLP
  c.activation = "gelu_tanh"              # MLP gate activation: gelu_tanh, gelu, silu, relu
  # Attention types repeat with this period; layer i is pattern[i % len(pattern)].
  # One period is one scanned block.
  c.attention_pattern = ("local",) * 5 + ("global",)
  c.sliding_window = 512                  # keys a local-layer query sees (itself included)
  c.rope_local_base = 10_000.0            # RoPE base frequency on local layers
  c.rope_global_base = 1_000_000.0        # RoPE base frequency on global layers
  c.rope_local_scale = 1.0                # linear RoPE scaling factor, local layers
  c.rope_global_scale = 1.0               # linear RoPE scaling factor, global layers
  c.rope_local_fraction = 1.0             # fraction of head_dim rotated, local layers
  c.rope_global_fraction = 1.0            # fraction of head_dim rotated, global layers
  # Queries are scaled by query_pre_attn_scalar ** -0.5; None means head_dim.
  c.query_pre_attn_scalar = config_dict.placeholder(float)
  c.attn_logit_softcap = config_dict.placeholder(float)   # tanh cap on attention logits
  c.final_logit_softcap = config_dict.placeholder(float)  # tanh cap on output logits
  c.norm_eps = 1e-6                       # RMSNorm epsilon
  c.use_qk_norm = True                    # RMSNorm on queries and keys (per head)
  c.use_post_attn_norm = True             # RMSNorm on the attention output
  c.use_post_ffw_norm = True              # RMSNorm on the MLP output
  c.dropout_rate = 0.0                    # dropout on each layer's output
  c.dtype = "float32"                     # compute dtype (softmax, norms, logits: float32)
  c.param_dtype = "float32"               # parameter storage dtype
  c.scan_layers = True                    # nn.scan over pattern blocks
  c.remat_policy = "none"                 # name from gemma_jax.remat.POLICIES
  return c


def default_config() -> config_dict.ConfigDict:
  """The whole experiment: the model and everything around it."""
  c = config_dict.ConfigDict()
  c.model = model_config()
  c.seed = 0                              # seeds parameter init, data order, dropout
  c.lock()
  return c


def validate(config: config_dict.ConfigDict) -> config_dict.ConfigDict:
  """Raises ConfigError naming the first inconsistent field; returns config."""
  m = config.model

  def need(ok, field, message):
    if not ok:
      raise ConfigError(f"model.{field}", message)

  for field in ("vocab_size", "d_model", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "mlp_dim", "sliding_window"):
    value = m[field]
    need(isinstance(value, int) and value > 0, field,
         f"must be a positive integer, got {value!r}")
  need(m.num_heads % m.num_kv_heads == 0, "num_kv_heads",
       f"num_heads={m.num_heads} is not divisible by num_kv_heads={m.num_kv_heads}")
  need(m.block_type in BLOCK_TYPES, "block_type",
       f"unknown block type {m.block_type!r}; known: {BLOCK_TYPES}")
  need(m.activation in ACTIVATIONS, "activation",
       f"unknown activation {m.activation!r}; known: {tuple(ACTIVATIONS)}")
  for field in ("dtype", "param_dtype"):
    need(m[field] in DTYPES, field, f"unknown dtype name {m[field]!r}; known: {DTYPES}")
  need(len(m.attention_pattern) > 0, "attention_pattern", "must not be empty")
  for kind in m.attention_pattern:
    need(kind in ATTENTION_TYPES, "attention_pattern",
         f"unknown attention type {kind!r}; known: {ATTENTION_TYPES}")
  for kind in ("local", "global"):
    fraction = m[f"rope_{kind}_fraction"]
    need(0.0 < fraction <= 1.0, f"rope_{kind}_fraction",
         f"must lie in (0, 1], got {fraction}")
    need(m[f"rope_{kind}_base"] > 0, f"rope_{kind}_base", "must be positive")
    need(m[f"rope_{kind}_scale"] > 0, f"rope_{kind}_scale", "must be positive")
  need(m.head_dim % 2 == 0, "head_dim", f"must be even for RoPE, got {m.head_dim}")
  for field in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap"):
    need(m[field] is None or m[field] > 0, field, f"must be positive or None, got {m[field]}")
  need(m.norm_eps > 0, "norm_eps", f"must be positive, got {m.norm_eps}")
  need(0.0 <= m.dropout_rate < 1.0, "dropout_rate",
       f"must lie in [0, 1), got {m.dropout_rate}")
  need(m.remat_policy in remat.POLICIES, "remat_policy",
       f"unknown remat policy {m.remat_policy!r}; known: {tuple(remat.POLICIES)}")
  return config
