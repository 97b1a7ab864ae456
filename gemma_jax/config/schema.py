"""The one config schema: every field, its default and its meaning, and what the
model's fields imply (each layer's attention type and shape, key/value sharing).

`default_config()` returns a locked `ml_collections.ConfigDict`; assigning a field
that does not exist raises, so a misspelt override is an error and never a silent
default. `model_config` and the other sections are tables of fields.
"""

import inspect
import re
from typing import Dict

from ml_collections import config_dict

ATTENTION_TYPES = ("local", "global")
BLOCK_TYPES = ("gemma3", "gemma4", "gpt3", "parallel")
ACTIVATIONS = ("gelu_tanh", "gelu", "silu", "relu")   # layers.mlp.ACTIVATIONS computes them
MOE_DISPATCHES = ("auto", "ragged", "loop", "gather", "sliced", "dense")
ATTENTION_KERNELS = ("einsum", "jax")
SCAN_UNROLLS = ("auto", "full", "none")
DTYPES = ("float32", "bfloat16", "float16")
QUANT_MODES = ("none", "int8", "int8_weights", "int4_weights", "fp8")
DATA_FORMATS = ("auto", "text", "chat")
MESH_AXES = ("data", "fsdp", "tensor", "expert")
# Rows of a batch split over every mesh axis that does not split the model's width.
BATCH_AXES = ("data", "fsdp", "expert")


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
  squares pooled to 256 tokens, gemma_jax.models.gemma3.vision) or Gemma 4's (patches of any
  aspect ratio, up to `max_soft_tokens` tokens, gemma_jax.models.gemma4.vision). The
  defaults are Gemma 3's; fields marked (gemma3) or (gemma4) are read by that tower only."""
  c = config_dict.ConfigDict()
  c.enabled = False                       # the model has the tower and takes images
  c.patch_size = 14                       # p, side of a square patch in pixels
  c.width = 1152                          # W, the encoder's residual width
  c.num_layers = 27                       # encoder layers (scanned and rematted as the text's)
  c.num_heads = 16                        # A, attention heads
  c.mlp_dim = 4304                        # F, hidden width of the encoder MLP
  c.activation = "gelu_tanh"              # encoder MLP activation, one of ACTIVATIONS
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
  # Device peak FLOP/s for the MFU reported; 0: the datasheet's dense bfloat16 peak of a
  # known accelerator (training.flops.DATASHEET_PEAK), none reported on a CPU.
  c.peak_flops = 0.0
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


_SECTIONS = {"model": model_config, "model.vision": vision_config, "data": data_config, "optimizer": optimizer_config,
             "train": train_config, "lora": lora_config, "checkpoint": checkpoint_config,
             "sample": sample_config, "mesh": mesh_config}
_FIELD_LINE = re.compile(r"\s*c\.(\w+) = .*?(?:#\s*(.*))?$")


def field_notes() -> Dict[str, str]:
  """{"model.remat_policy": what the field means, ...}: the comments beside (or just
  above) each field in this module's section functions, for an app's --help."""
  notes = {"seed": "seeds parameter init, data order, dropout"}
  for section, function in _SECTIONS.items():
    above = []
    for line in inspect.getsource(function).splitlines():
      if line.strip().startswith("#"):
        above.append(line.strip()[1:].strip())
        continue
      match = _FIELD_LINE.match(line)
      if match:
        notes[f"{section}.{match[1]}"] = " ".join(above + [match[2] or ""]).strip()
      above = []
  return notes
