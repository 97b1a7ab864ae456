"""The one config schema: every field, its default and its meaning.

`default_config()` returns a locked `ml_collections.ConfigDict`; assigning a field
that does not exist raises, so a misspelt override is an error and never a silent
default. `validate(config)` checks consistency before anything is traced or compiled
and raises `ConfigError` naming the offending field.
"""

import math
import numbers
import re

import jax

from ml_collections import config_dict

from gemma_jax import remat
from gemma_jax.layers.mlp import ACTIVATIONS

ATTENTION_TYPES = ("local", "global")
BLOCK_TYPES = ("gemma3", "gemma4", "gpt3", "parallel")
MOE_DISPATCHES = ("auto", "ragged", "loop", "gather", "sliced", "dense")
ATTENTION_KERNELS = ("einsum", "jax")
SCAN_UNROLLS = ("auto", "full", "none")
DTYPES = ("float32", "bfloat16", "float16")
QUANT_MODES = ("none", "int8", "int8_weights", "int4_weights", "fp8")
DATA_FORMATS = ("auto", "text", "chat")
MESH_AXES = ("data", "fsdp", "tensor", "expert")
# Rows of a batch split over every mesh axis that does not split the model's width.
BATCH_AXES = ("data", "fsdp", "expert")


def _validate_quant(m, need) -> None:
  need(m.quant in QUANT_MODES, "quant", f"unknown quantization mode {m.quant!r}; known: "
       f"{QUANT_MODES}")
  need(m.quant != "fp8" or jax.default_backend() != "cpu", "quant",
       "fp8 needs a GPU or TPU backend; this one is the CPU (use int8 or int8_weights)")
  need(_integer(m.quant_group_size) and m.quant_group_size >= 0, "quant_group_size",
       f"must be a non-negative integer, got {m.quant_group_size!r}")
  need(not m.quant_logits or not m.logits_via_embedding, "quant_logits",
       "the logits are the tied embedding table, which stays float: set "
       "logits_via_embedding=False or quant_logits=False")


def _integer(value) -> bool:
  """An int and not a bool: True would otherwise pass as the count 1."""
  return isinstance(value, int) and not isinstance(value, bool)


def _finite(value) -> bool:
  """A finite real number: not None, a bool, inf or NaN (an inf soft cap or RoPE scale
  validates as positive yet gives NaN logits or no rotation at all)."""
  return (isinstance(value, numbers.Real) and not isinstance(value, bool)
          and math.isfinite(value))


def layer_types(model: config_dict.ConfigDict) -> tuple:
  """The attention type of every layer of the model section: the pattern repeated, the
  last layer global when `final_layer_global`."""
  pattern = model.attention_pattern
  types = [pattern[i % len(pattern)] for i in range(model.num_layers)]
  if model.final_layer_global:
    types[-1] = "global"
  return tuple(types)


def attention_shape(model: config_dict.ConfigDict, kind: str) -> tuple:
  """(K, H): the key/value heads and head dim of a layer of attention type `kind`."""
  if kind == "global":
    return (model.global_num_kv_heads or model.num_kv_heads,
            model.global_head_dim or model.head_dim)
  return model.num_kv_heads, model.head_dim


def kv_sharing_modes(model: config_dict.ConfigDict) -> tuple:
  """Per layer: None, "store" (the last layer of its attention type before the shared
  ones: its keys and values serve them) or "reuse" (a shared layer)."""
  first = model.num_layers - model.num_kv_shared_layers
  types = layer_types(model)
  modes = [None] * first + ["reuse"] * model.num_kv_shared_layers
  if model.num_kv_shared_layers:
    for kind in set(types[first:]):
      modes[max(i for i in range(first) if types[i] == kind)] = "store"
  return tuple(modes)


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
  # ATTENTION_KERNELS: "einsum", ours (float32 softmax, soft cap); "jax",
  # jax.nn.dot_product_attention: cuDNN's fused kernel on GPU in bfloat16/float16.
  c.attention_kernel = "einsum"
  c.final_logit_softcap = config_dict.placeholder(float)  # tanh cap on output logits
  c.norm_eps = 1e-6                       # RMSNorm epsilon
  c.use_qk_norm = True                    # RMSNorm on queries and keys (per head)
  c.use_post_attn_norm = True             # RMSNorm on the attention output
  c.use_post_ffw_norm = True              # RMSNorm on the MLP output
  # RMSNorm multiplies by (1 + scale), scale zero-initialised (Gemma 3); False: by scale,
  # ones-initialised (Gemma 4).
  c.norm_plus_one = True
  c.use_value_norm = False                # RMSNorm without scale on values (per head)
  c.global_num_kv_heads = config_dict.placeholder(int)  # K on global layers; None: num_kv_heads
  c.global_head_dim = config_dict.placeholder(int)      # H on global layers; None: head_dim
  c.global_k_eq_v = False                 # global layers use their keys as values (no v projection)
  c.final_layer_global = False            # the last layer is global whatever the pattern says
  # Attention types in which tokens sharing a span id (an image) see each other both ways.
  c.bidirectional_span_types = ("local", "global")
  # Mixture of experts (block_type "gemma4"): routed experts beside the dense MLP.
  c.num_experts = 0                       # E, routed experts per layer; 0: dense MLP only
  c.experts_per_token = 1                 # k, experts each token is routed to (top-k)
  c.expert_mlp_dim = 0                    # F of each expert's gated MLP
  # MOE_DISPATCHES; auto: for fewer routed rows than experts (decoding) gather on GPU/TPU
  # and sliced on the CPU, else ragged on a TPU and loop on GPUs and the CPU (whose XLA
  # expands ragged_dot to every row times every expert).
  c.moe_dispatch = "auto"
  c.load_balance_loss_weight = 0.0        # weight of the load-balancing loss; 0 disables
  c.router_z_loss_weight = 0.0            # weight of the router z-loss (logsumexp^2); 0 disables
  # Gemma 4's small models (block_type "gemma4"). Per-layer input embeddings (PLE): each
  # layer adds a gated projection of its own P-wide slice of a [per_layer_vocab_size,
  # num_layers x P] token table, mixed with a projection of the embedded input.
  c.per_layer_input_dim = 0               # P; 0: no per-layer inputs
  c.per_layer_vocab_size = config_dict.placeholder(int)  # rows of the PLE table; None: vocab_size
  # The last num_kv_shared_layers layers compute no keys or values: each attends over
  # those of the last earlier layer of its attention type (and holds no decoding cache).
  c.num_kv_shared_layers = 0
  c.double_wide_mlp = False               # the shared-KV layers' MLPs are 2 x mlp_dim wide
  # Embeddings and logits (every family).
  c.scale_embeddings = True               # token embeddings x sqrt(D) (Gemma); False: as stored
  c.trainable_position_size = 0           # rows of a learned position embedding (GPT); 0: none
  c.sinusoidal_position_embedding = False  # add the untrainable sinusoidal embedding of positions
  c.logits_via_embedding = True           # logits by the tied embedding; False: own [D, V] kernel
  c.cast_logits_to_float32 = True         # logits in float32; False: in the compute dtype
  c.record_internal_nn_metrics = False    # layers sow their output's mean, std, fraction of zeros
  # GPT-3 (block_type "gpt3").
  c.fused_qkv = False                     # one [D, 3, N, H] projection for queries, keys, values
  c.layer_norm_float32 = True             # LayerNorm statistics in float32; False: compute dtype
  c.dropout_rate = 0.0                    # dropout on each layer's output
  c.dtype = "float32"                     # compute dtype (softmax, norms, logits: float32)
  c.param_dtype = "float32"               # parameter storage dtype
  c.scan_layers = True                    # nn.scan over pattern blocks
  # SCAN_UNROLLS, how the scan runs: "full" repeats its body in the program (no loop, so
  # no stacked per-block activations: faster and smaller without remat; the program grows
  # with depth), "none" loops (remat saves memory only in the loop); "auto": "full"
  # without remat, else "none".
  c.scan_unroll = "auto"
  c.remat_policy = "none"                 # name from gemma_jax.remat.POLICIES (text and vision)
  # Quantization of the projections (gemma_jax.quant), QUANT_MODES: "none"; "int8" and
  # "fp8" (GPU/TPU): weights and activations rounded, gradients straight through (training);
  # "int8_weights" and "int4_weights": weights stored as integers plus scales (serving;
  # gemma_jax.quant.quantize turns float parameters into them).
  c.quant = "none"
  c.quant_group_size = 32                 # int4_weights: one scale per this many inputs; 0: per channel
  c.quant_logits = False                  # quantize the untied logits projection too
  c.vision = vision_config()
  return c


def vision_config() -> config_dict.ConfigDict:
  """Image input: a vision tower turns each image into soft tokens that replace the
  prompt's placeholder ids. The tower is the block type's: Gemma 3's SigLIP (896 px
  squares pooled to 256 tokens, gemma_jax.models.vision) or Gemma 4's (patches of any
  aspect ratio, up to `max_soft_tokens` tokens, gemma_jax.models.gemma4_vision). The
  defaults are Gemma 3's; fields marked (gemma3) or (gemma4) are read by that tower only."""
  c = config_dict.ConfigDict()
  c.enabled = False                       # the model has the tower and takes images
  c.patch_size = 14                       # p, side of a square patch in pixels
  c.width = 1152                          # W, the encoder's residual width
  c.num_layers = 27                       # encoder layers (scanned and rematted as the text's)
  c.num_heads = 16                        # A, attention heads
  c.mlp_dim = 4304                        # F, hidden width of the encoder MLP
  c.activation = "gelu_tanh"              # encoder MLP activation, from layers.mlp.ACTIVATIONS
  c.layer_norm_eps = 1e-6                 # eps of the tower's norms and the soft-token RMSNorm
  c.boi_token_id = 255_999                # opens an image span (Gemma 3: the prompt's marker)
  c.eoi_token_id = 256_000                # closes an image span
  c.image_token_id = 262_144              # placeholder a soft token replaces (Gemma 4: the marker)
  # (gemma3) squares of S pixels, C channels, head dim W / A, M tokens per image.
  c.image_size = 896                      # S, images are resized to S x S pixels (S % p == 0)
  c.num_channels = 3                      # C, colour channels of the pixels
  c.tokens_per_image = 256                # M, soft tokens per image: a square whose side divides S / p
  c.double_newline_token_id = 108         # "\n\n", written around each image span
  # (gemma4) the image keeps its aspect ratio: at most max_soft_tokens * k^2 patches.
  # (Their defaults fit the shared fields' Gemma 3 values; Gemma 4's presets set all.)
  c.num_kv_heads = 16                     # key/value heads (divides num_heads)
  c.head_dim = 72                         # per head (a multiple of 4: the 2-D RoPE halves)
  c.pooling_kernel = 3                    # k, each soft token averages k x k patches
  c.max_soft_tokens = 280                 # soft tokens per image at most (the resize budget)
  c.position_embedding_size = 10_240      # patch columns / rows the position table holds
  c.rope_base = 100.0                     # base of the 2-D rotary frequencies
  c.standardize = False                   # soft tokens (x - std_bias) * std_scale before the projection
  c.use_clipped_linears = False           # every projection clamps its input and output
  c.pad_token_id = 0                      # the id placeholders read the per-layer input table with
  return c


def data_config() -> config_dict.ConfigDict:
  """Where the text comes from and how it becomes packed rows of tokens."""
  c = config_dict.ConfigDict()
  # Comma-separated globs of .txt/.jsonl files; None: the Python standard library source.
  c.path = config_dict.placeholder(str)
  c.text_field = "text"                   # key of a document's text in each JSONL line
  # "byte"; a SentencePiece .model, a tokenizers tokenizer.json, or a directory holding one
  # (a transformers checkpoint); None: train.init_from's directory when it holds one, else byte.
  c.tokenizer = config_dict.placeholder(str)
  # DATA_FORMATS: "text" documents; "chat" JSONL lines of "messages" ({role, content} turns,
  # the loss on the model's turns only); "auto": chat where a JSONL line holds "messages".
  c.format = "auto"
  c.seq_len = 256                         # T, tokens in one packed row
  c.eval_fraction = 0.01                  # fraction of the tokens held out for eval
  return c


def optimizer_config() -> config_dict.ConfigDict:
  """AdamW with linear warmup, cosine decay and global-norm clipping."""
  c = config_dict.ConfigDict()
  c.learning_rate = 1e-3                  # peak learning rate, reached after warmup
  c.warmup_steps = 100                    # linear warmup from 0 over these steps
  c.decay_steps = config_dict.placeholder(int)   # cosine horizon; None: train.steps
  c.end_learning_rate_ratio = 0.1         # the cosine ends at learning_rate * this
  c.b1 = 0.9                              # Adam first-moment decay
  c.b2 = 0.95                             # Adam second-moment decay
  c.eps = 1e-8                            # Adam denominator epsilon
  c.weight_decay = 0.1                    # decoupled weight decay
  c.no_decay = ("norm",)                  # regexes on param paths ("final_norm/scale") not decayed
  c.max_grad_norm = 1.0                   # clip gradients to this global norm; 0 disables
  c.grad_accum_steps = 1                  # micro-batches per step (divides train.batch_size)
  return c


def train_config() -> config_dict.ConfigDict:
  """The loop: length, batch, losses, evaluation and reporting."""
  c = config_dict.ConfigDict()
  c.steps = 1000                          # optimizer steps in the whole run
  c.batch_size = 16                       # B, rows per step over all processes
  c.z_loss = 0.0                          # weight of log(Z)^2 per token; 0 disables
  c.log_every = 50                        # steps between log lines and metrics.jsonl records
  c.eval_every = 200                      # steps between evaluations (and at the end); 0: end only
  c.eval_batches = 8                      # batches of batch_size eval rows per evaluation
  c.peak_flops = 0.0                      # device peak FLOP/s for MFU; 0: time a matmul
  c.progress_bar = True                   # a progress bar with ETA on stderr
  # Start from these weights (the optimizer starts fresh): a transformers save_pretrained
  # directory or a training workdir. The model section comes from the checkpoint.
  c.init_from = config_dict.placeholder(str)
  # With a workdir as init_from: the step of its checkpoints to start from. None: its
  # latest, fixed when the run starts and saved with the run's config, so that a LoRA
  # run keeps the base it was trained on while that workdir trains on.
  c.init_from_step = config_dict.placeholder(int)
  return c


def lora_config() -> config_dict.ConfigDict:
  """Low-rank adapters (gemma_jax.lora): W x + (alpha / rank) B A x on the targeted kernels,
  the base weights frozen."""
  c = config_dict.ConfigDict()
  c.rank = 0                              # r, adapter rank; 0: no adapters (full fine-tuning)
  c.alpha = 16.0                          # the adapters' output is scaled by alpha / rank
  c.dropout = 0.0                         # dropout on the adapters' input while training
  # Regexes on parameter paths ("blocks/layer_0/attn/q/kernel"): the kernels given adapters;
  # the MLP's, or a mixture of experts' dense (shared) MLP's ("moe/shared/gate/kernel").
  c.targets = (r"attn/(q|k|v|out)/kernel$", r"(mlp|moe/shared)/(gate|up|down)/kernel$")
  return c


def checkpoint_config() -> config_dict.ConfigDict:
  """Orbax checkpoints under workdir/checkpoints."""
  c = config_dict.ConfigDict()
  c.save_every = 500                      # steps between checkpoints (and always at the end)
  c.keep = 3                              # most recent checkpoints kept
  return c


def sample_config() -> config_dict.ConfigDict:
  """The sample generated at the end of training."""
  c = config_dict.ConfigDict()
  c.prompt = "def "                       # text the sample continues
  c.max_new_tokens = 200                  # tokens generated; 0 skips the sample
  c.temperature = 0.8                     # softmax temperature; 0 is greedy
  c.top_k = 40                            # sample among the k likeliest tokens; 0: all
  c.top_p = 1.0                           # then among the likeliest of this mass; 1: all
  return c


def mesh_config() -> config_dict.ConfigDict:
  """The device mesh; logical axes map onto it through `gemma_jax.sharding.RULES`."""
  c = config_dict.ConfigDict()
  c.data = -1                             # data-parallel ways; -1: the devices left over
  c.fsdp = 1                              # fully-sharded data-parallel ways (params split on embed)
  c.tensor = 1                            # tensor-parallel ways (heads, mlp, vocab)
  c.expert = 1                            # expert-parallel ways (MoE experts)
  # Call jax.distributed.initialize() (also done when JAX_COORDINATOR_ADDRESS is set).
  c.distributed = False
  return c


def default_config() -> config_dict.ConfigDict:
  """The whole experiment: the model and everything around it."""
  c = config_dict.ConfigDict()
  c.model = model_config()
  c.data = data_config()
  c.optimizer = optimizer_config()
  c.train = train_config()
  c.lora = lora_config()
  c.checkpoint = checkpoint_config()
  c.sample = sample_config()
  c.mesh = mesh_config()
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
    need(_integer(value) and value > 0, field, f"must be a positive integer, got {value!r}")
  need(m.vocab_size < 2**31, "vocab_size",
       f"token ids are int32: must be below 2**31, got {m.vocab_size}")
  need(m.num_heads % m.num_kv_heads == 0, "num_kv_heads",
       f"num_heads={m.num_heads} is not divisible by num_kv_heads={m.num_kv_heads}")
  need(m.block_type in BLOCK_TYPES, "block_type",
       f"unknown block type {m.block_type!r}; known: {BLOCK_TYPES}")
  need(m.activation in ACTIVATIONS, "activation",
       f"unknown activation {m.activation!r}; known: {tuple(ACTIVATIONS)}")
  for field in ("dtype", "param_dtype"):
    need(m[field] in DTYPES, field, f"unknown dtype name {m[field]!r}; known: {DTYPES}")
  need(isinstance(m.attention_pattern, (tuple, list)) and len(m.attention_pattern) > 0,
       "attention_pattern", f"must be a non-empty tuple of {ATTENTION_TYPES}, got "
       f"{m.attention_pattern!r}")
  for kind in m.attention_pattern:
    need(kind in ATTENTION_TYPES, "attention_pattern",
         f"unknown attention type {kind!r}; known: {ATTENTION_TYPES}")
  for kind in ("local", "global"):
    fraction = m[f"rope_{kind}_fraction"]
    need(_finite(fraction) and 0.0 < fraction <= 1.0, f"rope_{kind}_fraction",
         f"must lie in (0, 1], got {fraction!r}")
  positive = ("rope_local_base", "rope_global_base", "rope_local_scale", "rope_global_scale",
              "norm_eps")
  optional = ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap")
  for field in positive + optional:
    value = m[field]
    if value is None and field in optional:
      continue
    need(_finite(value) and value > 0, field, f"must be a finite positive number"
         f"{' or None' if field in optional else ''}, got {value!r}")
  # GPT-3 has learned positions and no RoPE (models/gpt3.py), so any head_dim loads.
  need(m.block_type == "gpt3" or m.head_dim % 2 == 0, "head_dim",
       f"must be even for RoPE, got {m.head_dim}")
  need(_finite(m.dropout_rate) and 0.0 <= m.dropout_rate < 1.0, "dropout_rate",
       f"must lie in [0, 1), got {m.dropout_rate!r}")
  need(m.scan_unroll in SCAN_UNROLLS, "scan_unroll",
       f"unknown scan unroll {m.scan_unroll!r}; known: {SCAN_UNROLLS}")
  need(m.remat_policy in remat.POLICIES, "remat_policy",
       f"unknown remat policy {m.remat_policy!r}; known: {tuple(remat.POLICIES)}")
  _validate_attention_options(m, need)
  _validate_quant(m, need)
  _validate_experts(m, need)
  _validate_embeddings_and_gpt3(config, need)
  if m.vision.enabled:
    _validate_vision(m, need)
  _validate_training(config)
  return config


def _validate_attention_options(m: config_dict.ConfigDict, need) -> None:
  """Per-type heads and head dims, and the span types; `need(ok, field, message)`."""
  if m.global_num_kv_heads is not None:
    need(_integer(m.global_num_kv_heads) and m.global_num_kv_heads > 0,
         "global_num_kv_heads", f"must be a positive integer or None, got "
         f"{m.global_num_kv_heads!r}")
    need(m.num_heads % m.global_num_kv_heads == 0, "global_num_kv_heads",
         f"num_heads={m.num_heads} is not divisible by global_num_kv_heads="
         f"{m.global_num_kv_heads}")
  if m.global_head_dim is not None:
    need(_integer(m.global_head_dim) and m.global_head_dim > 0
         and m.global_head_dim % 2 == 0, "global_head_dim",
         f"must be a positive even integer or None, got {m.global_head_dim!r}")
  need(isinstance(m.bidirectional_span_types, (tuple, list)), "bidirectional_span_types",
       f"must be a tuple of {ATTENTION_TYPES}, got {m.bidirectional_span_types!r}")
  for kind in m.bidirectional_span_types:
    need(kind in ATTENTION_TYPES, "bidirectional_span_types",
         f"unknown attention type {kind!r}; known: {ATTENTION_TYPES}")


def _validate_experts(m: config_dict.ConfigDict, need) -> None:
  """The mixture-of-experts fields; `need(ok, field, message)`."""
  need(_integer(m.num_experts) and m.num_experts >= 0, "num_experts",
       f"must be an integer >= 0, got {m.num_experts!r}")
  need(m.attention_kernel in ATTENTION_KERNELS, "attention_kernel",
       f"unknown kernel {m.attention_kernel!r}; known: {ATTENTION_KERNELS}")
  need(m.attention_kernel != "jax" or m.attn_logit_softcap is None, "attention_kernel",
       "jax.nn.dot_product_attention has no logit soft cap: use 'einsum' with "
       "attn_logit_softcap")
  need(m.moe_dispatch in MOE_DISPATCHES, "moe_dispatch",
       f"unknown dispatch {m.moe_dispatch!r}; known: {MOE_DISPATCHES}")
  for field in ("load_balance_loss_weight", "router_z_loss_weight"):
    need(_finite(m[field]) and m[field] >= 0, field,
         f"must be a finite number >= 0, got {m[field]!r}")
  _validate_gemma4_small(m, need)
  if not m.num_experts:
    return
  need(m.block_type == "gemma4", "num_experts",
       f"experts need block_type 'gemma4', got {m.block_type!r}")
  need(_integer(m.experts_per_token) and 1 <= m.experts_per_token <= m.num_experts,
       "experts_per_token", f"must lie in [1, num_experts={m.num_experts}], got "
       f"{m.experts_per_token!r}")
  need(_integer(m.expert_mlp_dim) and m.expert_mlp_dim > 0, "expert_mlp_dim",
       f"must be a positive integer when num_experts > 0, got {m.expert_mlp_dim!r}")


def _validate_gemma4_small(m: config_dict.ConfigDict, need) -> None:
  """Per-layer inputs, shared key/value layers, the double-wide MLP; `need(ok, field,
  message)`."""
  need(_integer(m.per_layer_input_dim) and m.per_layer_input_dim >= 0, "per_layer_input_dim",
       f"must be an integer >= 0, got {m.per_layer_input_dim!r}")
  if m.per_layer_vocab_size is not None:
    need(_integer(m.per_layer_vocab_size) and 0 < m.per_layer_vocab_size <= m.vocab_size,
         "per_layer_vocab_size", f"must lie in [1, vocab_size={m.vocab_size}] or be None, got "
         f"{m.per_layer_vocab_size!r}")
  shared = m.num_kv_shared_layers
  need(_integer(shared) and 0 <= shared < m.num_layers, "num_kv_shared_layers",
       f"must lie in [0, num_layers={m.num_layers}): a shared layer reuses an earlier "
       f"layer's keys and values, got {shared!r}")
  need(isinstance(m.double_wide_mlp, bool), "double_wide_mlp",
       f"must be a bool, got {m.double_wide_mlp!r}")
  for field, used in (("per_layer_input_dim", m.per_layer_input_dim),
                      ("num_kv_shared_layers", shared), ("double_wide_mlp", m.double_wide_mlp)):
    need(not used or m.block_type == "gemma4", field,
         f"is Gemma 4's: needs block_type 'gemma4', got {m.block_type!r}")
  if shared:
    types = layer_types(m)
    first = m.num_layers - shared
    orphans = sorted(set(types[first:]) - set(types[:first]))
    need(not orphans, "num_kv_shared_layers",
         f"the shared layers {first}..{m.num_layers - 1} include {orphans} attention, which "
         f"no earlier layer computes keys and values for")


def _validate_embeddings_and_gpt3(config: config_dict.ConfigDict, need) -> None:
  """Position embeddings and the GPT-3 fields; `need(ok, field, message)`."""
  m = config.model
  size = m.trainable_position_size
  need(_integer(size) and size >= 0, "trainable_position_size",
       f"must be an integer >= 0, got {size!r}")
  # A seq_len that is no integer is named by _validate_training.
  need(not size or not _integer(config.data.seq_len) or size >= config.data.seq_len,
       "trainable_position_size",
       f"{size} positions do not cover data.seq_len={config.data.seq_len}")
  need(not m.sinusoidal_position_embedding or m.d_model % 2 == 0,
       "sinusoidal_position_embedding", f"needs an even d_model, got {m.d_model}")
  need(not m.fused_qkv or m.block_type == "gpt3", "fused_qkv",
       f"only block_type 'gpt3' fuses its projections, got {m.block_type!r}")
  need(m.block_type != "gpt3" or m.num_kv_heads == m.num_heads, "num_kv_heads",
       f"GPT-3 has a key/value head per query head: num_heads={m.num_heads}, got "
       f"{m.num_kv_heads}")


def _validate_vision(m: config_dict.ConfigDict, need) -> None:
  """The vision section of an image model; `need(ok, field, message)`."""
  v = m.vision
  check = lambda ok, field, message: need(ok, f"vision.{field}", message)
  check(m.block_type in ("gemma3", "gemma4"), "enabled",
        f"vision towers are Gemma 3's and Gemma 4's: needs block_type 'gemma3' or 'gemma4', "
        f"got {m.block_type!r}")
  gemma4 = m.block_type == "gemma4"
  sizes = (("num_kv_heads", "head_dim", "pooling_kernel", "max_soft_tokens",
            "position_embedding_size") if gemma4 else
           ("image_size", "num_channels", "tokens_per_image"))
  for field in ("patch_size", "width", "num_layers", "num_heads", "mlp_dim") + sizes:
    check(_integer(v[field]) and v[field] > 0, field,
          f"must be a positive integer, got {v[field]!r}")
  check(v.activation in ACTIVATIONS, "activation",
        f"unknown activation {v.activation!r}; known: {tuple(ACTIVATIONS)}")
  for field in ("layer_norm_eps",) + (("rope_base",) if gemma4 else ()):
    check(_finite(v[field]) and v[field] > 0, field,
          f"must be a finite positive number, got {v[field]!r}")
  if gemma4:
    _validate_gemma4_vision(m, check)
  else:
    _validate_gemma3_vision(m, check)
  ids = ("boi_token_id", "eoi_token_id", "image_token_id") + (
      ("pad_token_id",) if gemma4 else ("double_newline_token_id",))
  for i, field in enumerate(ids):
    check(_integer(v[field]) and 0 <= v[field] < m.vocab_size, field,
          f"{v[field]!r} is outside the vocabulary [0, vocab_size={m.vocab_size})")
    for other in ids[:i]:
      check(v[field] != v[other], field, f"equals {other} ({v[other]}); the ids must differ")


def _validate_gemma3_vision(m: config_dict.ConfigDict, check) -> None:
  """The SigLIP tower's fields; `check(ok, field, message)`."""
  v = m.vision
  check(v.image_size % v.patch_size == 0, "patch_size",
        f"image_size={v.image_size} is not divisible by patch_size={v.patch_size}")
  check(v.width % v.num_heads == 0, "num_heads",
        f"width={v.width} is not divisible by num_heads={v.num_heads}")
  side = math.isqrt(v.tokens_per_image)
  grid = v.image_size // v.patch_size
  check(side * side == v.tokens_per_image and grid % side == 0, "tokens_per_image",
        f"must be a square whose side divides the {grid} x {grid} patch grid, got "
        f"{v.tokens_per_image}")
  # Then a span's tokens are all within each other's window, as transformers has it.
  check(v.tokens_per_image <= m.sliding_window, "tokens_per_image",
        f"an image span must fit in the local window: {v.tokens_per_image} > "
        f"sliding_window={m.sliding_window}")


def _validate_gemma4_vision(m: config_dict.ConfigDict, check) -> None:
  """Gemma 4's tower; `check(ok, field, message)`."""
  v = m.vision
  check(v.num_heads % v.num_kv_heads == 0, "num_kv_heads",
        f"num_heads={v.num_heads} is not divisible by num_kv_heads={v.num_kv_heads}")
  check(v.head_dim % 4 == 0, "head_dim",
        f"the 2-D RoPE rotates two halves by pairs: must be a multiple of 4, got {v.head_dim}")
  for field in ("standardize", "use_clipped_linears"):
    check(isinstance(v[field], bool), field, f"must be a bool, got {v[field]!r}")


def _validate_training(config: config_dict.ConfigDict) -> None:
  """Raises ConfigError naming the first inconsistent data/optimizer/train/... field."""

  def value(field):
    section, name = field.split(".")
    return config[section][name]

  def need(ok, field, message):
    if not ok:
      raise ConfigError(field, message)

  def integer(field, minimum):
    v = value(field)
    need(_integer(v) and v >= minimum, field, f"must be an integer >= {minimum}, got {v!r}")

  def number(field, interval):
    """interval: "(0, 1)", "[0, inf)", ... with 0, 1 or inf as bounds."""
    v = value(field)
    low, high = (float(b) for b in interval[1:-1].split(", "))
    need(_finite(v) and (v > low if interval[0] == "(" else v >= low)
         and (v < high if interval[-1] == ")" else v <= high), field,
         f"must lie in {interval}, got {v!r}")

  need(config.data.path is None or config.data.path.strip(), "data.path",
       "must name files, or be None for the standard library corpus")
  need(config.data.tokenizer is None or (isinstance(config.data.tokenizer, str)
                                         and config.data.tokenizer.strip()), "data.tokenizer",
       "must be 'byte', a tokenizer file or directory, or None (init_from's, else byte)")
  need(config.data.format in DATA_FORMATS, "data.format",
       f"unknown format {config.data.format!r}; known: {DATA_FORMATS}")
  need(config.train.init_from is None or (isinstance(config.train.init_from, str)
                                          and config.train.init_from.strip()),
       "train.init_from", "must name a transformers directory or a workdir, or be None")
  need(config.train.init_from_step is None or (_integer(config.train.init_from_step)
                                               and config.train.init_from_step >= 0),
       "train.init_from_step", f"must be an integer >= 0, or None (the latest), got "
       f"{config.train.init_from_step!r}")
  integer("data.seq_len", 2)
  number("data.eval_fraction", "(0, 1)")

  o = config.optimizer
  number("optimizer.learning_rate", "(0, inf)")
  integer("optimizer.warmup_steps", 0)
  integer("train.steps", 1)
  if o.decay_steps is not None:
    integer("optimizer.decay_steps", 1)
  horizon_field = "optimizer.decay_steps" if o.decay_steps is not None else "train.steps"
  need(value(horizon_field) > o.warmup_steps, horizon_field,
       f"must exceed optimizer.warmup_steps={o.warmup_steps}, got {value(horizon_field)}")
  number("optimizer.end_learning_rate_ratio", "[0, 1]")
  number("optimizer.b1", "[0, 1)")
  number("optimizer.b2", "[0, 1)")
  number("optimizer.eps", "(0, inf)")
  number("optimizer.weight_decay", "[0, inf)")
  number("optimizer.max_grad_norm", "[0, inf)")
  need(isinstance(o.no_decay, (tuple, list)), "optimizer.no_decay",
       f"must be a tuple of regexes, got {o.no_decay!r}")
  for pattern in o.no_decay:
    try:
      re.compile(pattern)
    except (re.error, TypeError) as error:
      raise ConfigError("optimizer.no_decay", f"{pattern!r} is not a regex: {error}") from None
  integer("optimizer.grad_accum_steps", 1)

  integer("train.batch_size", 1)
  need(config.train.batch_size % o.grad_accum_steps == 0, "optimizer.grad_accum_steps",
       f"does not divide train.batch_size={config.train.batch_size}, got {o.grad_accum_steps}")
  number("train.z_loss", "[0, inf)")
  integer("train.log_every", 1)
  integer("train.eval_every", 0)
  integer("train.eval_batches", 1)
  number("train.peak_flops", "[0, inf)")

  integer("lora.rank", 0)
  number("lora.alpha", "(0, inf)")
  number("lora.dropout", "[0, 1)")
  need(isinstance(config.lora.targets, (tuple, list)) and len(config.lora.targets) > 0,
       "lora.targets", f"must be a non-empty tuple of regexes, got {config.lora.targets!r}")
  for pattern in config.lora.targets:
    try:
      re.compile(pattern)
    except (re.error, TypeError) as error:
      raise ConfigError("lora.targets", f"{pattern!r} is not a regex: {error}") from None

  integer("checkpoint.save_every", 1)
  integer("checkpoint.keep", 1)

  sizes = {axis: config.mesh[axis] for axis in MESH_AXES}
  for axis, size in sizes.items():
    need(_integer(size) and (size >= 1 or size == -1), f"mesh.{axis}",
         f"must be a positive integer or -1, got {size!r}")
  free = [axis for axis, size in sizes.items() if size == -1]
  if len(free) > 1:
    raise ConfigError(f"mesh.{free[1]}", f"only one mesh axis may be -1 (the devices left "
                      f"over), got {free}: set the others' sizes (mesh.data is -1 by "
                      "default: e.g. mesh.data=1)")

  integer("sample.max_new_tokens", 0)
  number("sample.temperature", "[0, inf)")
  integer("sample.top_k", 0)
  need(config.sample.top_k <= config.model.vocab_size, "sample.top_k",
       f"exceeds model.vocab_size={config.model.vocab_size}, got {config.sample.top_k}")
  number("sample.top_p", "(0, 1]")


def check_sample_fits(config: config_dict.ConfigDict, prompt_length: int) -> None:
  """Raises ConfigError (sample.max_new_tokens) when the end-of-training sample, a prompt
  of `prompt_length` ids (BOS included) then sample.max_new_tokens, needs positions past
  the learned position table. The training loop calls it once its tokenizer has counted
  the prompt; `validate` has no tokenizer, and also guards configs that never train."""
  table, new = config.model.trainable_position_size, config.sample.max_new_tokens
  # As in `Sampler.sample`: the last new token is never fed back, so the positions used
  # are 0 .. prompt_length + new - 2.
  needed = prompt_length + new - 1
  if table and new and needed > table:
    raise ConfigError("sample.max_new_tokens",
                      f"{new} new tokens after the {prompt_length}-token sample.prompt (BOS "
                      f"included) need {needed} positions, more than "
                      f"model.trainable_position_size={table}: use at most "
                      f"{table - prompt_length + 1}, or 0 to skip the sample")
