"""The route's hand-back: a LoRA fine-tune of a transformers checkpoint, exported by
experiments/export.py as a transformers directory (adapters merged) and as peft
adapters; transformers and peft compute our logits."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers

import gemma_jax as gj
from gemma_jax.training import workdir as workdir_lib
from gemma_jax.training import init_from, loop
from gemma_jax.text import tokenizers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAT = os.path.join(REPO, "configs", "data", "chat_small.jsonl")
HF_SHAPE = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, num_hidden_layers=3, sliding_window=8,
                rms_norm_eps=1e-6)


def app(name, *flags):
  return subprocess.run([sys.executable, f"experiments/{name}.py", *flags], cwd=REPO,
                        capture_output=True, text=True, timeout=300)


def fine_tune_and_export(root, **model):
  """A random transformers Gemma 3 with the byte tokenizer's files, LoRA-tuned (with
  `model`'s fields) for a few steps on the shipped chat file, then exported both ways:
  `root`, which holds the directories."""
  torch.manual_seed(0)
  base = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**HF_SHAPE))
  base.save_pretrained(root / "base")
  tokenizers.ByteTokenizer().save(str(root / "base"))
  config = gj.get_config("gemma3-tiny")
  config.train.init_from = str(root / "base")
  config.model.update(model)
  config.data.update(path=CHAT, format="chat", seq_len=128, eval_fraction=0.05)
  config.lora.update(rank=4, alpha=8.0)
  config.train.update(steps=3, batch_size=8, log_every=3, eval_every=0, eval_batches=1,
                      progress_bar=False, peak_flops=1e9)
  config.optimizer.update(learning_rate=3e-2, warmup_steps=0)
  config.checkpoint.save_every = 3
  config.sample.max_new_tokens = 0
  loop.train(config, str(root / "lora"))
  for flags in ([f"--out={root / 'lora_hf'}"], [f"--out={root / 'lora_peft'}", "--peft"]):
    result = app("export", f"--workdir={root / 'lora'}", *flags)
    assert result.returncode == 0, result.stderr
    assert " of step 3 to " in result.stdout, result.stdout
  return root


@pytest.fixture(scope="module")
def route(tmp_path_factory):
  return fine_tune_and_export(tmp_path_factory.mktemp("route"))


def torch_logits(model, tokens):
  with torch.no_grad():
    return model(torch.as_tensor(tokens).long()).logits.numpy()


@pytest.mark.slow
def test_exported_model_and_adapters_give_our_logits_in_transformers_and_peft(route):
  config, params, _ = init_from.load_model(workdir=str(route / "lora"))
  tokens = np.random.RandomState(0).randint(0, 300, (2, 21)).astype(np.int32)
  ours = np.asarray(gj.transform(config).apply(params, jnp.asarray(tokens)))
  base = transformers.AutoModelForCausalLM.from_pretrained(route / "base").eval()
  before = torch_logits(base, tokens)
  assert np.abs(ours - before).max() > 1e-3   # the adapters changed the model
  exported = transformers.AutoModelForCausalLM.from_pretrained(route / "lora_hf").eval()
  np.testing.assert_allclose(torch_logits(exported, tokens), ours, atol=1e-4, rtol=0)
  with_adapters = peft.PeftModel.from_pretrained(base, route / "lora_peft").eval()
  np.testing.assert_allclose(torch_logits(with_adapters, tokens), ours, atol=1e-4, rtol=0)
  # The adapters name their base, so peft's AutoPeftModel finds it alone.
  adapter_config = json.loads((route / "lora_peft" / "adapter_config.json").read_text())
  assert adapter_config["base_model_name_or_path"] == str(route / "base")
  auto = peft.AutoPeftModelForCausalLM.from_pretrained(route / "lora_peft").eval()
  np.testing.assert_allclose(torch_logits(auto, tokens), ours, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_an_export_refuses_a_directory_of_the_other_kind(route):
  """Adapters written beside a model load onto it in transformers, silently: the base
  would no longer be the base. A model written over adapters deletes their weights (an
  old *.safetensors) and keeps adapter_config.json, which transformers then fails on."""
  for out, flags, kind in ((route / "lora_hf", ["--peft"], "a transformers model"),
                           (route / "lora_peft", [], "peft adapters")):
    before = sorted(os.listdir(out))
    result = app("export", f"--workdir={route / 'lora'}", f"--out={out}", *flags)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{out}: holds {kind}" in lines[0], lines
    assert sorted(os.listdir(out)) == before


@pytest.mark.slow
def test_qlora_export_merges_the_adapters_into_the_float_base(tmp_path):
  """QLoRA trains adapters over an int4 copy of the base; transformers reads float weights,
  so the export merges them into the float base: it computes what peft computes with the
  exported adapters on that base."""
  route = fine_tune_and_export(tmp_path, quant="int4_weights", quant_group_size=16)
  tokens = np.random.RandomState(0).randint(0, 300, (2, 21)).astype(np.int32)
  base = transformers.AutoModelForCausalLM.from_pretrained(route / "base").eval()
  before = torch_logits(base, tokens)
  with_adapters = torch_logits(peft.PeftModel.from_pretrained(base, route / "lora_peft").eval(),
                               tokens)
  assert np.abs(with_adapters - before).max() > 1e-3   # the adapters changed the model
  exported = transformers.AutoModelForCausalLM.from_pretrained(route / "lora_hf").eval()
  np.testing.assert_allclose(torch_logits(exported, tokens), with_adapters, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_exported_directory_samples_and_tokenizes_as_the_run(route):
  directory = route / "lora_hf"
  generation = json.loads((directory / "generation_config.json").read_text())
  assert generation["eos_token_id"] == [2, 260]   # eos and <end_of_turn>
  theirs = transformers.AutoTokenizer.from_pretrained(directory)
  text = "def f(x): return 'é' * x  # ünïcode"
  assert theirs.encode(text, add_special_tokens=False) == \
      tokenizers.ByteTokenizer().encode([text])[0].tolist()
  from_workdir = app("sample", f"--workdir={route / 'lora'}", "--prompt=def ",
                     "--max_new_tokens=12", "--temperature=0")
  from_export = app("sample", f"--hf_dir={directory}", "--prompt=def ", "--max_new_tokens=12",
                    "--temperature=0")
  assert from_export.returncode == 0, from_export.stderr
  assert from_export.stdout.splitlines()[0] == from_workdir.stdout.splitlines()[0]


@pytest.mark.slow
@pytest.mark.parametrize("make, flags, message", [
    (lambda w: None, [], "is not a training workdir"),
    (lambda w: (workdir_lib.save_config(str(w), gj.get_config("gemma3-tiny")),
                os.mkdir(w / "checkpoints")), [], "no checkpoint in"),
    (lambda w: (workdir_lib.save_config(str(w), gj.get_config("gemma3-tiny")),
                os.mkdir(w / "checkpoints")), ["--peft"], "lora.rank=0"),
    (lambda w: (w / "config.json").write_text(json.dumps(gj.hf.config_to_hf(
        gj.get_config("gemma3-tiny")))), [], "is a transformers directory"),
])
def test_export_of_a_workdir_without_a_model_is_one_error_line(tmp_path, make, flags, message):
  (tmp_path / "w").mkdir()
  make(tmp_path / "w")
  result = app("export", f"--workdir={tmp_path / 'w'}", f"--out={tmp_path / 'out'}", *flags)
  assert result.returncode == 1
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("export.py: error: ") and message in lines[0]
  assert not (tmp_path / "out").exists()


def _files(path):
  """{relative name: bytes} of every file under `path`."""
  return {os.path.relpath(os.path.join(folder, name), path):
          open(os.path.join(folder, name), "rb").read()
          for folder, _, names in os.walk(path) for name in names}


@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--overwrite"], ["--peft", "--overwrite"]])
def test_export_never_writes_over_the_base_the_run_adapts(route, flags):
  """`--out` naming the run's own train.init_from replaced the base with the merged
  weights, and the workdir then applied its adapters twice, silently. Refused before
  anything is read or written, --overwrite or not."""
  base = route / "base"
  before = _files(base)
  result = app("export", f"--workdir={route / 'lora'}", f"--out={base}", *flags)
  assert result.returncode == 1
  assert result.stderr.strip().splitlines() == [
      f"export.py: error: --out={base} is the checkpoint {route / 'lora'} was trained from "
      "(train.init_from), which an export never replaces: export to another directory"]
  assert _files(base) == before


@pytest.mark.slow
def test_export_writes_only_where_it_is_its_own(route, tmp_path):
  """A directory of other files lost them (every *.safetensors, pytorch_model*.bin and
  config.json went): refused in one line with nothing touched; --overwrite replaces it
  whole (none of its files beside ours); the workdir's own earlier export is replaced;
  a file the user added to it is named, not deleted."""
  out = tmp_path / "out"
  out.mkdir()
  foreign = {"vae_weights.safetensors": os.urandom(64), "pytorch_model_notes.bin": b"notes",
             "config.json": b'{"model_type": "vae"}'}
  for name, data in foreign.items():
    (out / name).write_bytes(data)
  export = lambda *flags: app("export", f"--workdir={route / 'lora'}", f"--out={out}", *flags)
  result = export()
  assert result.returncode == 1
  assert result.stderr.strip().splitlines() == [
      f"export.py: error: {out}: holds a transformers model (config.json) that no export "
      "of this kind and run wrote: export to a new or empty directory, or pass "
      "overwrite=True (export.py --overwrite) to replace it whole"]
  assert _files(out) == foreign
  assert export("--overwrite").returncode == 0
  assert sorted(os.listdir(out)) == sorted(os.listdir(route / "lora_hf"))
  assert _files(out)["model.safetensors"] == _files(route / "lora_hf")["model.safetensors"]
  assert export().returncode == 0   # its own earlier export
  (out / "README.md").write_text("# notes\n")
  result = export()
  assert result.returncode == 1 and "holds README.md, which the earlier export did not " \
      "write" in result.stderr
  assert (out / "README.md").read_text() == "# notes\n"
