"""`validate(config)`: the config's consistency, checked before anything is traced or
compiled; a `ConfigError` names the first offending field."""

import math
import numbers
import re

import jax
from ml_collections import config_dict

from gemma_jax import remat
from gemma_jax.config.schema import (ACTIVATIONS, ATTENTION_KERNELS, ATTENTION_TYPES,
                                     BLOCK_TYPES, DATA_FORMATS, DTYPES, MESH_AXES,
                                     MOE_DISPATCHES, QUANT_MODES, SCAN_UNROLLS, ConfigError,
                                     layer_types)


def is_integer(value) -> bool:
  """An int and not a bool: True would otherwise pass as the count 1."""
  return isinstance(value, int) and not isinstance(value, bool)


def is_finite(value) -> bool:
  """A finite real number a float holds: not None, a bool, inf, NaN or an int past 1e308
  (a checkpoint's config.json may hold one; an inf soft cap or RoPE scale validates as
  positive yet gives NaN logits or no rotation at all)."""
  if not isinstance(value, numbers.Real) or isinstance(value, bool):
    return False
  try:
    return math.isfinite(value)
  except OverflowError:
    return False


def _validate_quant(m, need) -> None:
  need(m.quant in QUANT_MODES, "quant", f"unknown quantization mode {m.quant!r}; known: "
       f"{QUANT_MODES}")
  need(m.quant != "fp8" or jax.default_backend() != "cpu", "quant",
       "fp8 needs a GPU or TPU backend; this one is the CPU (use int8 or int8_weights)")
  need(is_integer(m.quant_group_size) and m.quant_group_size >= 0, "quant_group_size",
       f"must be a non-negative integer, got {m.quant_group_size!r}")
  need(not m.quant_logits or not m.logits_via_embedding, "quant_logits",
       "the logits are the tied embedding table, which stays float: set "
       "logits_via_embedding=False or quant_logits=False")


def validate(config: config_dict.ConfigDict) -> config_dict.ConfigDict:
  """Raises ConfigError naming the first inconsistent field; returns config."""
  m = config.model

  def need(ok, field, message):
    if not ok:
      raise ConfigError(f"model.{field}", message)

  for field in ("vocab_size", "d_model", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "mlp_dim", "sliding_window"):
    value = m[field]
    need(is_integer(value) and value > 0, field, f"must be a positive integer, got {value!r}")
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
    need(is_finite(fraction) and 0.0 < fraction <= 1.0, f"rope_{kind}_fraction",
         f"must lie in (0, 1], got {fraction!r}")
  positive = ("rope_local_base", "rope_global_base", "rope_local_scale", "rope_global_scale",
              "norm_eps")
  optional = ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap")
  for field in positive + optional:
    value = m[field]
    if value is None and field in optional:
      continue
    need(is_finite(value) and value > 0, field, f"must be a finite positive number"
         f"{' or None' if field in optional else ''}, got {value!r}")
  # GPT-3 has learned positions and no RoPE (models/gpt3.py), so any head_dim loads.
  need(m.block_type == "gpt3" or m.head_dim % 2 == 0, "head_dim",
       f"must be even for RoPE, got {m.head_dim}")
  need(is_finite(m.dropout_rate) and 0.0 <= m.dropout_rate < 1.0, "dropout_rate",
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
    need(is_integer(m.global_num_kv_heads) and m.global_num_kv_heads > 0,
         "global_num_kv_heads", f"must be a positive integer or None, got "
         f"{m.global_num_kv_heads!r}")
    need(m.num_heads % m.global_num_kv_heads == 0, "global_num_kv_heads",
         f"num_heads={m.num_heads} is not divisible by global_num_kv_heads="
         f"{m.global_num_kv_heads}")
  if m.global_head_dim is not None:
    need(is_integer(m.global_head_dim) and m.global_head_dim > 0
         and m.global_head_dim % 2 == 0, "global_head_dim",
         f"must be a positive even integer or None, got {m.global_head_dim!r}")
  need(isinstance(m.bidirectional_span_types, (tuple, list)), "bidirectional_span_types",
       f"must be a tuple of {ATTENTION_TYPES}, got {m.bidirectional_span_types!r}")
  for kind in m.bidirectional_span_types:
    need(kind in ATTENTION_TYPES, "bidirectional_span_types",
         f"unknown attention type {kind!r}; known: {ATTENTION_TYPES}")


def _validate_experts(m: config_dict.ConfigDict, need) -> None:
  """The mixture-of-experts fields; `need(ok, field, message)`."""
  need(is_integer(m.num_experts) and m.num_experts >= 0, "num_experts",
       f"must be an integer >= 0, got {m.num_experts!r}")
  need(m.attention_kernel in ATTENTION_KERNELS, "attention_kernel",
       f"unknown kernel {m.attention_kernel!r}; known: {ATTENTION_KERNELS}")
  need(m.attention_kernel != "jax" or m.attn_logit_softcap is None, "attention_kernel",
       "jax.nn.dot_product_attention has no logit soft cap: use 'einsum' with "
       "attn_logit_softcap")
  need(m.moe_dispatch in MOE_DISPATCHES, "moe_dispatch",
       f"unknown dispatch {m.moe_dispatch!r}; known: {MOE_DISPATCHES}")
  for field in ("load_balance_loss_weight", "router_z_loss_weight"):
    need(is_finite(m[field]) and m[field] >= 0, field,
         f"must be a finite number >= 0, got {m[field]!r}")
  _validate_gemma4_small(m, need)
  if not m.num_experts:
    return
  need(m.block_type == "gemma4", "num_experts",
       f"experts need block_type 'gemma4', got {m.block_type!r}")
  need(is_integer(m.experts_per_token) and 1 <= m.experts_per_token <= m.num_experts,
       "experts_per_token", f"must lie in [1, num_experts={m.num_experts}], got "
       f"{m.experts_per_token!r}")
  need(is_integer(m.expert_mlp_dim) and m.expert_mlp_dim > 0, "expert_mlp_dim",
       f"must be a positive integer when num_experts > 0, got {m.expert_mlp_dim!r}")


def _validate_gemma4_small(m: config_dict.ConfigDict, need) -> None:
  """Per-layer inputs, shared key/value layers, the double-wide MLP; `need(ok, field,
  message)`."""
  need(is_integer(m.per_layer_input_dim) and m.per_layer_input_dim >= 0, "per_layer_input_dim",
       f"must be an integer >= 0, got {m.per_layer_input_dim!r}")
  if m.per_layer_vocab_size is not None:
    need(is_integer(m.per_layer_vocab_size) and 0 < m.per_layer_vocab_size <= m.vocab_size,
         "per_layer_vocab_size", f"must lie in [1, vocab_size={m.vocab_size}] or be None, got "
         f"{m.per_layer_vocab_size!r}")
  shared = m.num_kv_shared_layers
  need(is_integer(shared) and 0 <= shared < m.num_layers, "num_kv_shared_layers",
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
  need(is_integer(size) and size >= 0, "trainable_position_size",
       f"must be an integer >= 0, got {size!r}")
  # A seq_len that is no integer is named by _validate_training.
  need(not size or not is_integer(config.data.seq_len) or size >= config.data.seq_len,
       "trainable_position_size",
       f"{size} positions do not cover data.seq_len={config.data.seq_len}")
  need(not m.sinusoidal_position_embedding or m.d_model % 2 == 0,
       "sinusoidal_position_embedding", f"needs an even d_model, got {m.d_model}")
  need(not m.fused_qkv or m.block_type == "gpt3", "fused_qkv",
       f"only block_type 'gpt3' fuses its projections, got {m.block_type!r}")
  need(m.block_type != "gpt3" or m.num_kv_heads == m.num_heads, "num_kv_heads",
       f"GPT-3 has a key/value head per query head: num_heads={m.num_heads}, got "
       f"{m.num_kv_heads}")
  for field in ("use_post_attn_norm", "use_post_ffw_norm"):
    need(m.block_type != "gpt3" or not m[field], field,
         "GPT-3's layer has no post-norms (its norms come before attention and MLP)")


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
    check(is_integer(v[field]) and v[field] > 0, field,
          f"must be a positive integer, got {v[field]!r}")
  check(v.activation in ACTIVATIONS, "activation",
        f"unknown activation {v.activation!r}; known: {tuple(ACTIVATIONS)}")
  for field in ("layer_norm_eps",) + (("rope_base",) if gemma4 else ()):
    check(is_finite(v[field]) and v[field] > 0, field,
          f"must be a finite positive number, got {v[field]!r}")
  if gemma4:
    _validate_gemma4_vision(m, check)
  else:
    _validate_gemma3_vision(m, check)
  ids = ("boi_token_id", "eoi_token_id", "image_token_id") + (
      ("pad_token_id",) if gemma4 else ("double_newline_token_id",))
  for i, field in enumerate(ids):
    check(is_integer(v[field]) and 0 <= v[field] < m.vocab_size, field,
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


class _Fields:
  """Checks of one config's fields named "section.name"; each raises ConfigError naming
  its field."""

  def __init__(self, config: config_dict.ConfigDict):
    self.config = config

  def value(self, field: str):
    section, name = field.split(".")
    return self.config[section][name]

  @staticmethod
  def need(ok: bool, field: str, message: str) -> None:
    if not ok:
      raise ConfigError(field, message)

  def integer(self, field: str, minimum: int) -> None:
    v = self.value(field)
    self.need(is_integer(v) and v >= minimum, field,
              f"must be an integer >= {minimum}, got {v!r}")

  def number(self, field: str, interval: str) -> None:
    """interval: "(0, 1)", "[0, inf)", ... with 0, 1 or inf as bounds."""
    v = self.value(field)
    low, high = (float(b) for b in interval[1:-1].split(", "))
    self.need(is_finite(v) and (v > low if interval[0] == "(" else v >= low)
              and (v < high if interval[-1] == ")" else v <= high), field,
              f"must lie in {interval}, got {v!r}")

  def regexes(self, field: str, non_empty: bool) -> None:
    patterns = self.value(field)
    self.need(isinstance(patterns, (tuple, list)) and (len(patterns) > 0 or not non_empty),
              field, f"must be a {'non-empty ' if non_empty else ''}tuple of regexes, got "
              f"{patterns!r}")
    for pattern in patterns:
      try:
        re.compile(pattern)
      except (re.error, TypeError) as error:
        raise ConfigError(field, f"{pattern!r} is not a regex: {error}") from None


def _validate_training(config: config_dict.ConfigDict) -> None:
  """Raises ConfigError naming the first inconsistent data/optimizer/train/... field."""
  fields = _Fields(config)
  _validate_data(config, fields)
  _validate_optimizer(config, fields)
  _validate_run(config, fields)


def _validate_data(config: config_dict.ConfigDict, f: _Fields) -> None:
  """The data section and where training starts from."""
  f.need(config.data.path is None or config.data.path.strip(), "data.path",
         "must name files, or be None for the standard library corpus")
  f.need(config.data.tokenizer is None or (isinstance(config.data.tokenizer, str)
                                           and config.data.tokenizer.strip()),
         "data.tokenizer",
         "must be 'byte', a tokenizer file or directory, or None (init_from's, else byte)")
  f.need(config.data.format in DATA_FORMATS, "data.format",
         f"unknown format {config.data.format!r}; known: {DATA_FORMATS}")
  f.need(config.train.init_from is None or (isinstance(config.train.init_from, str)
                                            and config.train.init_from.strip()),
         "train.init_from", "must name a transformers directory or a workdir, or be None")
  f.need(config.train.init_from_step is None or (is_integer(config.train.init_from_step)
                                                 and config.train.init_from_step >= 0),
         "train.init_from_step", f"must be an integer >= 0, or None (the latest), got "
         f"{config.train.init_from_step!r}")
  f.integer("data.seq_len", 2)
  f.number("data.eval_fraction", "(0, 1)")


def _validate_optimizer(config: config_dict.ConfigDict, f: _Fields) -> None:
  """The optimizer section and the schedule's horizon."""
  o = config.optimizer
  f.number("optimizer.learning_rate", "(0, inf)")
  f.integer("optimizer.warmup_steps", 0)
  f.integer("train.steps", 1)
  if o.decay_steps is not None:
    f.integer("optimizer.decay_steps", 1)
  horizon_field = "optimizer.decay_steps" if o.decay_steps is not None else "train.steps"
  f.need(f.value(horizon_field) > o.warmup_steps, horizon_field,
         f"must exceed optimizer.warmup_steps={o.warmup_steps}, got {f.value(horizon_field)}")
  f.number("optimizer.end_learning_rate_ratio", "[0, 1]")
  f.number("optimizer.b1", "[0, 1)")
  f.number("optimizer.b2", "[0, 1)")
  f.number("optimizer.eps", "(0, inf)")
  f.number("optimizer.weight_decay", "[0, inf)")
  f.number("optimizer.max_grad_norm", "[0, inf)")
  f.regexes("optimizer.no_decay", non_empty=False)
  f.integer("optimizer.grad_accum_steps", 1)


def _validate_run(config: config_dict.ConfigDict, f: _Fields) -> None:
  """The train, lora, checkpoint, mesh and sample sections."""
  f.integer("train.batch_size", 1)
  f.need(config.train.batch_size % config.optimizer.grad_accum_steps == 0,
         "optimizer.grad_accum_steps", f"does not divide train.batch_size="
         f"{config.train.batch_size}, got {config.optimizer.grad_accum_steps}")
  f.number("train.z_loss", "[0, inf)")
  f.integer("train.log_every", 1)
  f.integer("train.eval_every", 0)
  f.integer("train.eval_batches", 1)
  f.number("train.peak_flops", "[0, inf)")

  f.integer("lora.rank", 0)
  f.number("lora.alpha", "(0, inf)")
  f.number("lora.dropout", "[0, 1)")
  f.regexes("lora.targets", non_empty=True)

  f.integer("checkpoint.save_every", 1)
  f.integer("checkpoint.keep", 1)

  sizes = {axis: config.mesh[axis] for axis in MESH_AXES}
  for axis, size in sizes.items():
    f.need(is_integer(size) and (size >= 1 or size == -1), f"mesh.{axis}",
           f"must be a positive integer or -1, got {size!r}")
  free = [axis for axis, size in sizes.items() if size == -1]
  if len(free) > 1:
    raise ConfigError(f"mesh.{free[1]}", f"only one mesh axis may be -1 (the devices left "
                      f"over), got {free}: set the others' sizes (mesh.data is -1 by "
                      "default: e.g. mesh.data=1)")

  f.integer("sample.max_new_tokens", 0)
  f.number("sample.temperature", "[0, inf)")
  f.integer("sample.top_k", 0)
  f.need(config.sample.top_k <= config.model.vocab_size, "sample.top_k",
         f"exceeds model.vocab_size={config.model.vocab_size}, got {config.sample.top_k}")
  f.number("sample.top_p", "(0, 1]")


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
