"""peft interop (gemma_jax.peft_adapters): our adapters run by transformers + peft give our
logits, peft's adapters run by us give peft's, and what cannot be mapped is refused."""

import json
import os
import re

import jax
import numpy as np
import peft
import pytest
import torch
import transformers

import gemma_jax as gj
from gemma_jax import lora
from gemma_jax.checkpoints import peft_adapters, safetensors_io
from gemma_jax.hf import CheckpointError
import torch_reference

RANK, ALPHA = 4, 8.0
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Ours: one scanned (local, local, global) block and one more local layer.
GEMMA3 = dict(vocab_size=128, d_model=48, num_heads=4, num_kv_heads=2, head_dim=16,
              mlp_dim=80, num_layers=4, attention_pattern=("local", "local", "global"),
              sliding_window=5)
GEMMA4 = dict(vocab_size=128, num_layers=4, d_model=48, num_heads=4, num_kv_heads=2,
              head_dim=16, global_head_dim=32, global_num_kv_heads=1, mlp_dim=80,
              sliding_window=5)


def our_config(preset, model):
  config = gj.get_config(preset)
  config.model.update(model)
  config.lora.rank, config.lora.alpha = RANK, ALPHA
  return config


def random_leaves(tree, seed, scale):
  leaves, structure = jax.tree.flatten(tree)
  rng = np.random.default_rng(seed)
  return jax.tree.unflatten(structure, [
      (scale * rng.standard_normal(x.shape)).astype(np.float32) for x in leaves])


def peft_logits(model, tokens):
  return torch_reference.torch_logits(model, tokens)


@pytest.mark.slow
@pytest.mark.parametrize("preset, model, targets", [
    ("gemma3-tiny", GEMMA3, None), ("gemma4-tiny", GEMMA4, None),
    ("gemma4-moe-tiny", GEMMA4, None),
    ("gemma4-tiny", dict(GEMMA4, per_layer_input_dim=8), (r"kernel$",))],
                         ids=["gemma3", "gemma4", "gemma4-moe", "gemma4-per-layer-all-linear"])
def test_saved_adapters_run_in_peft_as_ours(tmp_path, preset, model, targets):
  """A random gemma_jax model (norm scales too) with random nonzero adapters on the
  default targets (of a mixture of experts: its dense MLP), or on every linear module as
  peft's "all-linear" adapts them (the per-layer inputs' projection, outside the layers,
  included): hf.save + peft_adapters.save, read by AutoModelForCausalLM + PeftModel in float32,
  give our logits; peft's own save_pretrained of them writes our tensor names and values."""
  config = our_config(preset, model)
  if targets:
    config.lora.targets = targets
  params = gj.transform(config).init(jax.random.key(0), np.zeros((1, 1), np.int32))
  base, adapters = lora.split(params)
  base = jax.tree_util.tree_map_with_path(
      lambda path, x: (np.random.default_rng(7).normal(0.0, 0.5, x.shape).astype(np.float32)
                       if path[-1].key == "scale" else x), base)
  adapters = random_leaves(adapters, seed=1, scale=0.3)
  gj.hf.save(str(tmp_path / "base"), lora.disabled(config), base)
  peft_adapters.save(str(tmp_path / "adapter"), config, adapters, base_model_name_or_path="base")

  saved = json.loads((tmp_path / "adapter" / peft_adapters.CONFIG_FILE).read_text())
  if preset == "gemma3-tiny":
    assert saved["target_modules"] == sorted(PROJECTIONS)
  else:   # the global layer 3 takes keys as values: no v_proj there, so exact names
    assert re.fullmatch(saved["target_modules"], "model.layers.0.self_attn.v_proj")
    assert not re.fullmatch(saved["target_modules"], "model.layers.3.self_attn.v_proj")
    assert re.fullmatch(saved["target_modules"], "model.layers.3.mlp.down_proj")
  if targets:
    assert re.fullmatch(saved["target_modules"], "model.per_layer_model_projection")
  assert (saved["peft_type"], saved["task_type"], saved["r"], saved["lora_alpha"]) == (
      "LORA", "CAUSAL_LM", RANK, ALPHA)
  reference = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path / "base"), dtype=torch.float32)
  reference = peft.PeftModel.from_pretrained(reference, str(tmp_path / "adapter")).eval()
  tokens = torch_reference.token_batch(config.model.vocab_size)
  ours = np.asarray(gj.transform(config).apply(lora.combine(base, adapters), tokens))
  theirs = peft_logits(reference, tokens)
  plain = np.asarray(gj.transform(lora.disabled(config)).apply(base, tokens))
  assert np.abs(ours - plain).max() > 0.1          # the adapters matter
  gap = np.abs(ours - theirs).max()
  print(f"{preset}: ours vs transformers+peft max-abs {gap:.2e}")
  assert gap <= 1e-4

  reference.save_pretrained(str(tmp_path / "resaved"))
  ours_written = safetensors_io.read(str(tmp_path / "adapter" / peft_adapters.WEIGHTS_FILE))
  peft_written = safetensors_io.read(str(tmp_path / "resaved" / peft_adapters.WEIGHTS_FILE))
  assert sorted(ours_written) == sorted(peft_written)
  assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in peft_written
  for name, value in peft_written.items():
    np.testing.assert_array_equal(ours_written[name], value)


@pytest.fixture(scope="module")
def peft_directory(tmp_path_factory):
  """A random transformers Gemma 3 (base dir) and a peft LoRA on it with random A and B
  (adapter dir), saved by peft itself; and the peft model."""
  root = tmp_path_factory.mktemp("peft")
  torch.manual_seed(0)
  model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
      vocab_size=128, hidden_size=48, intermediate_size=80, num_attention_heads=4,
      num_key_value_heads=2, head_dim=16, num_hidden_layers=5, sliding_window=5,
      layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 1
      + ["sliding_attention", "sliding_attention"]))
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.normal_(0.0, 0.5)
  model.eval().save_pretrained(str(root / "base"))
  tuned = peft.get_peft_model(model, peft.LoraConfig(
      r=RANK, lora_alpha=ALPHA, target_modules=PROJECTIONS, task_type="CAUSAL_LM"))
  with torch.no_grad():
    for name, p in tuned.named_parameters():
      if "lora_" in name:
        p.normal_(0.0, 0.3)
  tuned.eval().save_pretrained(str(root / "adapter"))
  return str(root / "base"), str(root / "adapter"), tuned


@pytest.mark.parametrize("scan_layers", [True, False])
def test_peft_adapters_load_and_give_peft_logits(peft_directory, scan_layers):
  base_dir, adapter_dir, tuned = peft_directory
  config, base = gj.hf.load(base_dir, scan_layers=scan_layers)
  config.lora.rank, config.lora.alpha = RANK, ALPHA
  adapters = peft_adapters.load(adapter_dir, config)
  tokens = torch_reference.token_batch(128)
  ours = np.asarray(gj.transform(config).apply(lora.combine(base, adapters), tokens))
  theirs = peft_logits(tuned, tokens)
  with tuned.disable_adapter():
    assert np.abs(theirs - peft_logits(tuned, tokens)).max() > 0.1   # the adapters matter
  gap = np.abs(ours - theirs).max()
  print(f"scan_layers={scan_layers}: ours vs peft max-abs {gap:.2e}")
  assert gap <= 1e-4


def _edited_copy(src, dst, **changes):
  os.makedirs(dst)
  for name in os.listdir(src):
    with open(os.path.join(src, name), "rb") as f:
      data = f.read()
    with open(os.path.join(dst, name), "wb") as f:
      f.write(data)
  file = os.path.join(dst, peft_adapters.CONFIG_FILE)
  with open(file) as f:
    adapter_config = json.load(f)
  adapter_config.update(changes)
  with open(file, "w") as f:
    json.dump(adapter_config, f)
  return dst


_Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize("changes, lora_fields, edit, message", [
    (dict(use_rslora=True), {}, None, r"use_rslora=True is not supported"),
    (dict(use_dora=True), {}, None, r"use_dora=True is not supported"),
    (dict(rank_pattern={"q_proj": 8}), {}, None, r"rank_pattern"),
    ({}, dict(rank=8), None, r"r=4, but config\.lora\.rank=8"),
    ({}, dict(alpha=16.0), None, r"lora_alpha=8.*config\.lora\.alpha=16"),
    ({}, dict(targets=(r"attn/q/kernel$",)), None,
     r"adapter_model\.safetensors: layers\.0\.mlp\.down_proj\.lora_A\.weight \(and 59 more\) "
     r"are adapters config\.lora\.targets does not"),
    ({}, {}, lambda t: {k: v for k, v in t.items() if "gate_proj" not in k},
     r"adapter_model\.safetensors: no tensor for layers\.0\.mlp\.gate_proj"),
    ({}, {}, lambda t: dict(t, **{_Q_A: np.ascontiguousarray(t[_Q_A].T)}),
     r"adapter_model\.safetensors: layers\.0\.self_attn\.q_proj\.lora_A\.weight "
     r"\(48, 4\) != expected \(4, 48\)$"),
])
def test_load_refuses_what_does_not_fit(peft_directory, tmp_path, changes, lora_fields, edit,
                                        message):
  """peft options we do not implement, rank and alpha other than config.lora's, adapted
  modules other than config.lora.targets' (extra ones; missing ones), and an adapter of
  the right size but not the right shape (transposed)."""
  base_dir, adapter_dir, _ = peft_directory
  directory = _edited_copy(adapter_dir, str(tmp_path / "edited"), **changes)
  if edit:
    file = os.path.join(directory, peft_adapters.WEIGHTS_FILE)
    safetensors_io.write(file, edit(safetensors_io.read(file)))
  config = gj.hf.load_config(base_dir)
  config.lora.rank, config.lora.alpha = RANK, ALPHA
  config.lora.update(lora_fields)
  with pytest.raises(CheckpointError, match=message):
    peft_adapters.load(directory, config)


def test_gpt2_is_refused(tmp_path):
  config = gj.get_config("gpt3-52k")
  config.lora.rank = RANK
  with pytest.raises(CheckpointError, match=r"config\.model\.block_type.*'gpt3'"):
    peft_adapters.save(str(tmp_path), config, lora.init_adapters(config, jax.random.key(0)))


def test_a_failed_save_leaves_the_earlier_export_whole(tmp_path, monkeypatch):
  """A save that fails between its two files (here writing the config) had left new
  adapters beside the old adapter_config.json, which loads without a word under the old
  alpha. The earlier export stays byte for byte, with nothing left beside it."""
  config = our_config("gemma3-tiny", GEMMA3)
  adapters = lora.init_adapters(config, jax.random.key(0))
  out = tmp_path / "peft"
  peft_adapters.save(str(out), config, random_leaves(adapters, 0, 0.1))
  before = {name: (out / name).read_bytes() for name in os.listdir(out)}

  def full_disk(*args, **kwargs):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(json, "dump", full_disk)
  with pytest.raises(OSError, match="No space left"):
    peft_adapters.save(str(out), config, random_leaves(adapters, 1, 0.1))
  assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
  assert os.listdir(tmp_path) == ["peft"]
