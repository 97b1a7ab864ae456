"""The config schema: locked fields, presets that validate, and named errors."""

import math

import jax
import jax.numpy as jnp
import pytest

import gemma_jax as gj
from gemma_jax import config as config_lib


def test_locked_config_rejects_misspelt_field():
  config = gj.get_config("gemma3-tiny")
  with pytest.raises(AttributeError, match="num_layer"):
    config.model.num_layer = 3
  with pytest.raises(AttributeError, match="lerning_rate"):
    config.lerning_rate = 1.0


def test_field_types_are_enforced():
  config = gj.get_config("gemma3-tiny")
  with pytest.raises(TypeError):
    config.model.num_layers = "six"


@pytest.mark.parametrize("name", sorted(gj.PRESETS))
def test_every_preset_validates(name):
  config = gj.get_config(name)
  assert gj.validate(config) is config
  assert config.model.name == name


def test_unknown_preset_lists_known_ones():
  with pytest.raises(ValueError, match="gemma3-1b"):
    gj.get_config("gemma3-2b")


INVALID = [
    ("num_kv_heads", 3, "model.num_kv_heads", "not divisible"),
    ("d_model", 0, "model.d_model", "positive"),
    ("mlp_dim", -4, "model.mlp_dim", "positive"),
    ("sliding_window", 0, "model.sliding_window", "positive"),
    ("block_type", "llama", "model.block_type", "unknown block type"),
    ("activation", "swish3", "model.activation", "unknown activation"),
    ("remat_policy", "most", "model.remat_policy", "unknown remat policy"),
    ("scan_unroll", "partial", "model.scan_unroll", "unknown scan unroll"),
    ("dtype", "float8", "model.dtype", "unknown dtype"),
    ("param_dtype", "int8", "model.param_dtype", "unknown dtype"),
    ("rope_global_fraction", 0.0, "model.rope_global_fraction", r"\(0, 1\]"),
    ("rope_local_fraction", 1.5, "model.rope_local_fraction", r"\(0, 1\]"),
    ("attention_pattern", ("local", "sliding"), "model.attention_pattern",
     "unknown attention type"),
    ("attention_pattern", (), "model.attention_pattern", "empty"),
    ("head_dim", 31, "model.head_dim", "even"),
    ("final_logit_softcap", -1.0, "model.final_logit_softcap", "positive"),
    ("dropout_rate", 1.0, "model.dropout_rate", r"\[0, 1\)"),
    ("norm_eps", 0.0, "model.norm_eps", "positive"),
    ("attention_kernel", "flash", "model.attention_kernel", "unknown kernel"),
    ("vocab_size", 2**31, "model.vocab_size", r"int32: must be below 2\*\*31"),
]


@pytest.mark.parametrize("field", ["use_post_attn_norm", "use_post_ffw_norm"])
def test_gpt3_refuses_post_norms_its_layer_does_not_have(field):
  """GPT-3's layer says what it does (norms before attention and MLP only); a post-norm
  asked of it would be ignored without a word."""
  config = gj.get_config("gpt3-52k")
  config.model[field] = True
  with pytest.raises(config_lib.ConfigError, match=f"model.{field}: GPT-3's layer has no "
                     "post-norms"):
    gj.validate(config)


def test_jax_attention_kernel_refuses_a_soft_cap():
  config = gj.get_config("gemma3-tiny")
  config.model.update(attention_kernel="jax", attn_logit_softcap=50.0)
  with pytest.raises(gj.config.ConfigError, match="model.attention_kernel.*soft cap"):
    gj.validate(config)


@pytest.mark.parametrize("field,value,name,message", INVALID)
def test_invalid_config_names_its_field(field, value, name, message):
  config = gj.get_config("gemma3-tiny")
  config.model[field] = value
  with pytest.raises(config_lib.ConfigError, match=message) as error:
    gj.validate(config)
  assert error.value.field == name
  assert str(error.value).startswith(f"config.{name}:")


def test_gpt3_head_dim_may_be_odd():
  """GPT-3 has learned positions, no RoPE: a GPT-2 checkpoint with n_embd=21, n_head=3
  validates and traces. RoPE families still need an even head_dim."""
  config = gj.get_config("gpt3-52k")
  config.model.update(d_model=21, num_heads=3, num_kv_heads=3, head_dim=7)
  model = gj.transform(gj.validate(config))
  tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
  params = jax.eval_shape(model.init, jax.random.key(0), tokens)
  assert jax.eval_shape(model.apply, params, tokens).shape == (1, 8, config.model.vocab_size)
  for block_type in ("gemma3", "gemma4", "parallel"):
    config = gj.get_config(f"{block_type}-tiny")
    config.model.head_dim = 7
    with pytest.raises(config_lib.ConfigError, match="even for RoPE, got 7"):
      gj.validate(config)


def test_transform_validates_before_building():
  config = gj.get_config("gemma3-tiny")
  config.model.num_heads = 5
  with pytest.raises(config_lib.ConfigError, match="num_kv_heads"):
    gj.transform(config)


def test_end_of_training_sample_must_fit_the_learned_positions():
  """A table of 128 positions, a 5-token prompt: 124 new tokens use positions 0..127;
  125 (or the default 200) raise naming sample.max_new_tokens."""
  config = gj.get_config("gpt3-52k")
  config.model.trainable_position_size = config.data.seq_len = 128
  gj.validate(config)   # the sample is checked once the training loop has a tokenizer
  for new in (200, 125):
    config.sample.max_new_tokens = new
    with pytest.raises(config_lib.ConfigError, match=f"{new} new tokens after the 5-token "
                       r"sample.prompt .* need \d+ positions, more than "
                       r"model.trainable_position_size=128: use at most 124") as error:
      config_lib.check_sample_fits(config, 5)
    assert error.value.field == "sample.max_new_tokens"
  for new in (124, 0):
    config.sample.max_new_tokens = new
    config_lib.check_sample_fits(config, 5)
  config.model.trainable_position_size = 0   # no table: nothing to run past
  config.sample.max_new_tokens = 10_000
  config_lib.check_sample_fits(config, 5)


TRAINING_INVALID = [
    ("optimizer", "decay_steps", 0, "optimizer.decay_steps", ">= 1, got 0"),
    ("optimizer", "decay_steps", -5, "optimizer.decay_steps", ">= 1, got -5"),
    ("sample", "top_k", 513, "sample.top_k", "exceeds model.vocab_size=512, got 513"),
]


@pytest.mark.parametrize("section,field,value,name,message", TRAINING_INVALID)
def test_invalid_training_config_names_its_field(section, field, value, name, message):
  config = gj.get_config("gemma3-tiny")
  config[section][field] = value
  with pytest.raises(config_lib.ConfigError, match=message) as error:
    gj.validate(config)
  assert error.value.field == name


def assign(config, path, value):
  """config["a.b.c"] = value for a dotted path."""
  *sections, field = path.split(".")
  for section in sections:
    config = config[section]
  config[field] = value


# Values of the wrong kind. A bool is an int to Python: num_layers=True would build
# a one-layer model.
WRONG_KINDS = [
    ("gemma3-tiny", "model.num_layers", True, "positive integer, got True"),
    ("gemma3-tiny", "model.global_num_kv_heads", True, "positive integer or None, got True"),
    ("gemma3-tiny", "model.trainable_position_size", True, "integer >= 0, got True"),
    ("gemma4-moe-tiny", "model.num_experts", True, "integer >= 0, got True"),
    ("gemma4-moe-tiny", "model.experts_per_token", True, "got True"),
    ("gemma4-moe-tiny", "model.expert_mlp_dim", True, "positive integer .*, got True"),
    ("gemma3-tiny-vision", "model.vision.num_channels", True, "positive integer, got True"),
    ("gemma3-tiny-vision", "model.vision.double_newline_token_id", True,
     "True is outside the vocabulary"),
    ("gemma3-tiny", "train.steps", True, "integer >= 1, got True"),
    ("gemma3-tiny", "sample.top_k", True, "integer >= 0, got True"),
    ("gemma3-tiny", "mesh.fsdp", True, "positive integer or -1, got True"),
    # None where a number or tuple is expected used to raise a bare TypeError.
    ("gemma3-tiny", "model.attention_pattern", None, "non-empty tuple .*, got None"),
    ("gemma3-tiny", "model.bidirectional_span_types", None, "tuple .*, got None"),
    ("gemma3-tiny", "model.rope_global_fraction", None, r"\(0, 1\], got None"),
    ("gemma3-tiny", "model.rope_local_base", None, "finite positive number, got None"),
    ("gemma3-tiny", "model.rope_local_scale", None, "finite positive number, got None"),
    ("gemma3-tiny", "model.norm_eps", None, "finite positive number, got None"),
    ("gemma3-tiny", "model.dropout_rate", None, r"\[0, 1\), got None"),
    ("gemma3-tiny", "model.load_balance_loss_weight", None, "finite number >= 0, got None"),
    ("gemma3-tiny-vision", "model.vision.layer_norm_eps", None, "finite positive number"),
    ("gemma3-tiny", "optimizer.learning_rate", None, r"\(0, inf\), got None"),
    ("gemma3-tiny", "optimizer.no_decay", None, "tuple of regexes, got None"),
    ("gemma3-tiny", "train.z_loss", None, r"\[0, inf\), got None"),
    ("gpt3-52k", "data.seq_len", None, "integer >= 2, got None"),
    # inf passed as positive: soft caps of inf give NaN logits (inf * tanh(x / inf)), a
    # RoPE scale of inf stops the rotation; NaN must fail as well.
    ("gemma3-tiny", "model.final_logit_softcap", math.inf, "finite positive number or None"),
    ("gemma3-tiny", "model.attn_logit_softcap", math.inf, "finite positive number or None"),
    ("gemma3-tiny", "model.query_pre_attn_scalar", math.inf, "finite positive .*, got inf"),
    ("gemma3-tiny", "model.rope_global_scale", math.inf, "finite positive number, got inf"),
    ("gemma3-tiny", "model.rope_global_base", math.inf, "finite positive number, got inf"),
    ("gemma3-tiny", "model.norm_eps", math.inf, "finite positive number, got inf"),
    ("gemma3-tiny", "model.norm_eps", math.nan, "finite positive number, got nan"),
    ("gemma3-tiny", "model.router_z_loss_weight", math.inf, "finite number >= 0, got inf"),
    ("gemma3-tiny-vision", "model.vision.layer_norm_eps", math.inf, "finite positive"),
]


@pytest.mark.parametrize("preset,path,value,message", WRONG_KINDS)
def test_wrong_kind_of_value_names_its_field(preset, path, value, message):
  config = gj.get_config(preset)
  assign(config, path, value)
  with pytest.raises(config_lib.ConfigError, match=message) as error:
    gj.validate(config)
  assert error.value.field == path
