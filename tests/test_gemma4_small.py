"""Gemma 4's small models against transformers' Gemma4ForCausalLM: per-layer inputs
(PLE), shared key/value layers and the double-wide MLP in logits, checkpoints both ways
and greedy decoding; the small presets' parameter counts; sharded training; train.py;
configs transformers would refuse."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers

import gemma_jax as gj
from gemma_jax import decoder, planning, sharding
from gemma_jax.checkpoints import safetensors_io
from gemma_jax.inference import decoding, sampler
from gemma_jax.models.gemma4 import plan as gemma4_plan
from gemma_jax.training import metrics
from test_gemma4 import VOCAB, random_model, saved_checkpoint, token_batch
from test_sharding import MESHES
from test_training import REPO
import torch_reference
from torch_reference import torch_logits

# Layer types with the default pattern (5 local, 1 global, the last layer global).
SHAPES = {
    # Per-layer inputs alone, a table smaller than the vocabulary.
    "ple_7_layers": dict(num_hidden_layers=7, num_key_value_heads=2, global_head_dim=16,
                         sliding_window=5, hidden_size_per_layer_input=8,
                         vocab_size_per_layer_input=VOCAB),
    # 9 layers, the last 3 shared (local, local, global): both types reuse. (transformers
    # 5.24 runs shared layers only beside per-layer inputs: without them its forward
    # slices a None.)
    "shared_kv_9_layers": dict(num_hidden_layers=9, num_key_value_heads=2, global_head_dim=16,
                               sliding_window=5, num_kv_shared_layers=3,
                               hidden_size_per_layer_input=2, vocab_size_per_layer_input=VOCAB),
    # Everything with keys as values on global layers; the shared half is a scanned period.
    "ple_shared_double_wide_k_eq_v_12_layers": dict(
        num_hidden_layers=12, num_key_value_heads=1, global_head_dim=16,
        num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=4,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
        num_kv_shared_layers=6, use_double_wide_mlp=True, final_logit_softcapping=20.0),
    # E2B's pattern (4 local, 1 global) at 11 layers, 5 shared with double-wide MLPs.
    "e2b_pattern_11_layers": dict(
        num_hidden_layers=11, num_key_value_heads=1, global_head_dim=16, sliding_window=6,
        layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 2
        + ["full_attention"], hidden_size_per_layer_input=4,
        vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=5, use_double_wide_mlp=True),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def checkpoint(request, tmp_path_factory):
  return saved_checkpoint(request.param, SHAPES[request.param], tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [True, False])
def test_loaded_logits_match_transformers(checkpoint, scan_layers):
  _, model, path, expected = checkpoint
  config, params = gj.hf.load(path, scan_layers=scan_layers)
  m = config.model
  assert m.per_layer_input_dim == (model.config.hidden_size_per_layer_input or 0)
  assert m.num_kv_shared_layers == model.config.num_kv_shared_layers
  shared = [i for i, mode in enumerate(gemma4_plan.kv_sharing_modes(m)) if mode == "reuse"]
  unrolled = decoder.unstack_layers(params, m)
  for i in shared:   # no key/value weights of their own
    assert "k" not in unrolled[f"layers_{i}"]["attn"]
  ours = np.asarray(gj.transform(config).apply(params, jnp.asarray(token_batch())))
  assert np.abs(expected).max() > 1.0
  assert np.abs(ours - expected).max() <= 1e-4


@pytest.mark.slow
def test_save_round_trip_through_transformers(checkpoint, tmp_path):
  _, model, path, _ = checkpoint
  torch_reference.assert_save_round_trip(model, path, str(tmp_path),
                                         transformers.Gemma4ForCausalLM, VOCAB)
  reloaded = transformers.AutoConfig.from_pretrained(str(tmp_path))
  for field in ("hidden_size_per_layer_input", "vocab_size_per_layer_input",
                "num_kv_shared_layers", "use_double_wide_mlp", "layer_types"):
    assert getattr(reloaded, field) == getattr(model.config, field), field


def test_key_value_weights_of_shared_layers_in_a_checkpoint_are_skipped(tmp_path):
  """Published checkpoints hold k/v projections and norms for the shared layers, which
  transformers does not build; they load as it does, any other extra tensor is refused."""
  model = random_model(1, **SHAPES["shared_kv_9_layers"])
  model.save_pretrained(str(tmp_path))
  file = str(tmp_path / "model.safetensors")
  tensors = safetensors_io.read(file)
  donor = {k: v for k, v in tensors.items() if k.startswith("model.layers.0.self_attn.")}
  for i in (6, 7, 8):
    for name in ("k_proj", "v_proj", "k_norm"):
      tensors[f"model.layers.{i}.self_attn.{name}.weight"] = donor[
          f"model.layers.0.self_attn.{name}.weight"]
  safetensors_io.write(file, tensors)
  config, params = gj.hf.load(str(tmp_path))
  ours = np.asarray(gj.transform(config).apply(params, jnp.asarray(token_batch())))
  assert np.abs(ours - torch_logits(model, token_batch())).max() <= 1e-4
  tensors["model.layers.5.self_attn.extra.weight"] = donor["model.layers.0.self_attn.k_proj.weight"]
  safetensors_io.write(file, tensors)
  with pytest.raises(gj.hf.CheckpointError, match=r"unexpected tensors: \['layers.5.self_attn.extra"):
    gj.hf.load(str(tmp_path))


NEW = 14


@pytest.mark.slow
def test_greedy_decoding_equals_transformers_generate(tmp_path):
  """PLE + shared key/value layers (both types) + double-wide MLPs, window 4; rows of 9,
  3 and 6 prompt tokens and 14 new ones: past the window in every row."""
  shape = SHAPES["ple_shared_double_wide_k_eq_v_12_layers"]
  model = random_model(5, **shape)
  model.save_pretrained(str(tmp_path))
  config, params = gj.hf.load(str(tmp_path))
  lengths = np.array([9, 3, 6], np.int32)
  prompts = np.random.RandomState(2).randint(3, VOCAB, (3, 9)).astype(np.int32)
  prompts = prompts * (np.arange(9) < lengths[:, None])
  dec = decoding.make_decoding(config)
  ours = np.asarray(sampler.generate(
      dec, params, prompts, lengths, jax.random.key(0), np.zeros((0,), np.int32),
      max_new_tokens=NEW, cache_length=9 + NEW, cache_dtype="float32"))
  for b, length in enumerate(lengths):
    with torch.no_grad():
      theirs = model.generate(torch.as_tensor(prompts[b:b + 1, :length]), do_sample=False,
                              max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    np.testing.assert_array_equal(ours[b], theirs[0, length:].numpy())
  assert config.model.sliding_window < lengths.min() + NEW
  _, cache = dec.prefill(params, jnp.asarray(prompts), jnp.asarray(lengths), cache_length=32,
                         cache_dtype="float32")
  assert sorted(cache.layers, key=lambda n: int(n.split("_")[1])) == [
      f"layers_{i}" for i in range(6)]          # layers 6..11 hold no cache


@pytest.mark.slow
def test_shared_layers_hold_no_cache_bytes():
  """gemma4-e2b at 32k positions: 20 of 35 layers shared (16 local, 4 global)."""
  config = gj.get_config("gemma4-e2b")
  own = gemma4_plan.kv_sharing_modes(config.model)
  types = decoder.layer_types(config.model)
  length, window = 32768, 512
  got = planning.cache_bytes(config, batch_size=1, cache_length=length)["cache"]
  unshared = gj.get_config("gemma4-e2b")
  unshared.model.num_kv_shared_layers = 0
  every = planning.cache_bytes(unshared, batch_size=1, cache_length=length)["cache"]
  # bfloat16 keys and values of one kv head: 256 wide on local layers, 512 on global ones.
  ring = {"local": 2 * window * 256 * 2, "global": 2 * length * 512 * 2}
  saved = sum(ring[kind] for kind, mode in zip(types, own) if mode == "reuse")
  assert every - got == saved
  assert (types[15:].count("local"), types[15:].count("global")) == (16, 4)
  assert 0.42 < got / every < 0.43       # 15 layers' rings of 35: 57% saved


# Published small Gemma 4 text configurations, written out independently of our presets.
HF_SHAPES = {
    "gemma4-e2b": dict(num_hidden_layers=35, hidden_size=1536, intermediate_size=6144,
                       num_attention_heads=8, num_key_value_heads=1,
                       layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7,
                       num_kv_shared_layers=20, use_double_wide_mlp=True),
    "gemma4-e4b": dict(num_hidden_layers=42, hidden_size=2560, intermediate_size=10240,
                       num_attention_heads=8, num_key_value_heads=2, num_kv_shared_layers=18),
    "gemma4-e2b-tiny": dict(vocab_size=512, num_hidden_layers=10, hidden_size=128,
                            intermediate_size=256, num_attention_heads=4, num_key_value_heads=1,
                            head_dim=32, global_head_dim=64, sliding_window=64,
                            layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 2,
                            hidden_size_per_layer_input=16, vocab_size_per_layer_input=512,
                            num_kv_shared_layers=5, use_double_wide_mlp=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HF_SHAPES))
def test_parameter_count_matches_transformers(name):
  shape = dict(dict(vocab_size=262144, head_dim=256, global_head_dim=512, sliding_window=512,
                    attention_k_eq_v=False, hidden_size_per_layer_input=256,
                    vocab_size_per_layer_input=262144, final_logit_softcapping=30.0),
               **HF_SHAPES[name])
  with torch.device("meta"):
    model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**shape))
  theirs = (sum(p.numel() for p in model.parameters())
            + sum(b.numel() for n, b in model.named_buffers() if n.endswith("layer_scalar")))
  for scan_layers in (True, False):
    config = gj.get_config(name)
    config.model.scan_layers = scan_layers
    shapes = jax.eval_shape(gj.transform(config).init, jax.random.key(0),
                            jax.ShapeDtypeStruct((1, 8), np.int32))
    assert sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(shapes)) == theirs
  # Raises unless transformers reads every architecture field back alike.
  hf = gj.hf.config_to_hf(gj.get_config(name))
  assert (hf["hidden_size_per_layer_input"], hf["num_kv_shared_layers"]) == (
      shape["hidden_size_per_layer_input"], shape["num_kv_shared_layers"])


def test_small_presets_scan_their_shared_layers():
  segments = decoder.scan_segments(gj.get_config("gemma4-e2b").model)
  assert [(s.name, s.start, s.count, {dict(spec.fields).get("kv_sharing") for spec in s.specs})
          for s in segments] == [
      ("blocks", 0, 2, {None}), ("shared_blocks", 15, 4, {"reuse"})]   # 10..14 hold the "store"s


def small_model(**fields):
  return dict(block_type="gemma4", global_head_dim=16, global_num_kv_heads=2,
              norm_plus_one=False, use_value_norm=True, final_layer_global=True,
              num_layers=5, per_layer_input_dim=4, num_kv_shared_layers=3,
              double_wide_mlp=True, **fields)


@pytest.mark.slow
def test_sharded_loss_and_gradients_equal_one_device():
  """A PLE + shared key/value model on fsdp4 x tensor2 against one device, in one step.

  Not over AdamW steps: the last layer's scalar has a gradient of ~1e-7 (the final norm
  undoes any scale), so Adam turns reduction-order noise into full-size updates. And
  gradients within 2e-3 of each leaf's largest: with per-layer inputs, batch-order
  noise alone (data8, parameters whole) moves some by 2.4e-4 of it (norm gradients are
  sums of cancelling terms), where a sharding error moves them by O(1)."""
  from test_sharding import batches, config_with  # pylint: disable=import-outside-toplevel
  config = config_with(MESHES["fsdp4_tensor2"], **small_model())
  model = gj.transform(config)
  batch = batches()[0]

  def loss(params):
    logits = model.apply(params, batch["tokens"], positions=batch["positions"],
                         segment_ids=batch["segment_ids"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1], batch["tokens"][:, 1:]).mean()

  params = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 16), jnp.int32))
  want_loss, want = jax.jit(jax.value_and_grad(loss))(params)
  mesh = sharding.make_mesh(config.mesh)
  shardings = sharding.param_shardings(config, mesh)
  with sharding.activate(mesh):
    got_loss, got = jax.jit(jax.value_and_grad(loss), in_shardings=(shardings,))(
        jax.device_put(params, shardings))
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
  for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                          jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(g, w, atol=1e-6 + 2e-3 * np.abs(w).max(),
                               err_msg=jax.tree_util.keystr(path))
  table = shardings["per_layer_inputs"]["embed"]["embedding"]
  assert table.spec == jax.sharding.PartitionSpec("tensor", "fsdp")


@pytest.mark.slow
def test_train_py_trains_a_ple_model(tmp_path):
  """configs/gemma3_tiny.py:gemma4-e2b-tiny through experiments/train.py on the embedded
  corpus (the standard library's source), shortened to 8 steps with a sample at the end."""
  workdir = tmp_path / "run"
  process = subprocess.run(
      [sys.executable, os.path.join(REPO, "experiments", "train.py"),
       f"--config={os.path.join(REPO, 'configs', 'gemma3_tiny.py')}:gemma4-e2b-tiny", f"--workdir={workdir}",
       "--config.data.seq_len=32", "--config.train.steps=8", "--config.train.batch_size=8",
       "--config.train.log_every=1", "--config.train.eval_every=0",
       "--config.train.progress_bar=False", "--config.optimizer.warmup_steps=2",
       "--config.sample.max_new_tokens=8"],
      cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
  assert process.returncode == 0, process.stderr
  losses = [r["loss"] for r in metrics.read_records(str(workdir)) if "loss" in r]
  assert len(losses) == 8 and np.isfinite(losses).all()
  assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("fields,message", [
    (dict(num_kv_shared_layers=4), r"num_kv_shared_layers: the shared layers 1..4 include "
     r"\['global'\] attention, which no earlier layer"),
    (dict(num_kv_shared_layers=5), r"num_kv_shared_layers: must lie in \[0, num_layers=5\)"),
    (dict(per_layer_input_dim=-1), r"per_layer_input_dim: must be an integer >= 0"),
    (dict(per_layer_vocab_size=1000), r"per_layer_vocab_size: must lie in \[1, vocab_size"),
])
def test_configs_transformers_would_refuse_are_named(fields, message):
  config = gj.get_config("gemma4-e2b-tiny")
  config.model.update(dict(dict(num_layers=5, num_kv_shared_layers=2), **fields))
  with pytest.raises(gj.ConfigError, match=r"config\.model\." + message):
    gj.validate(config)


def test_small_model_fields_need_gemma4():
  config = gj.get_config("gemma3-tiny")
  config.model.per_layer_input_dim = 8
  with pytest.raises(gj.ConfigError, match=r"model.per_layer_input_dim: is Gemma 4's"):
    gj.validate(config)


@pytest.mark.slow
def test_activation_statistics_name_layers_of_both_scanned_segments():
  """gemma4-e2b-tiny scanned (layers 5..9 in shared_blocks) against unrolled."""
  models = {}
  for scan_layers in (True, False):
    config = gj.get_config("gemma4-e2b-tiny")
    config.model.update(scan_layers=scan_layers, record_internal_nn_metrics=True)
    models[scan_layers] = gj.transform(config)
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, 512, (2, 12)), jnp.int32)
  params = models[True].init(jax.random.key(0), tokens)
  scanned = models[True].apply(params, tokens, return_aux=True)[1]["activation_stats"]
  unrolled = models[False].apply(decoder.unstack_layers(params, config.model), tokens,
                                 return_aux=True)[1]["activation_stats"]
  assert sorted(scanned) == sorted(unrolled)
  assert {f"activation_mean/layer_{i}" for i in range(10)} <= set(scanned)
  for name, value in unrolled.items():
    np.testing.assert_allclose(scanned[name], value, rtol=1e-5, err_msg=name)
