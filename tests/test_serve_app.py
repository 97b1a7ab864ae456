"""experiments/serve.py end to end, driven by the README's own "Serve it" commands: the
server started as written (on a random tiny model's transformers directory named like
the README's run), then the README's curl and openai-client lines run as written; the
greedy reply against the full forward pass; SIGTERM drains and exits."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest

import gemma_jax as gj
from gemma_jax.text import chat, tokenizers
from test_decoding import random_params, tiny

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)


def serve_block():
  """The lines of the README's bash block that starts experiments/serve.py."""
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    blocks = re.findall(r"^```bash\n(.*?)^```", f.read(), re.DOTALL | re.MULTILINE)
  block = next(b for b in blocks if "experiments/serve.py" in b)
  return block.strip().splitlines()


def greedy_reply(config, params, tokenizer, question, steps):
  """The reply the full forward pass picks greedily, up to a stop id."""
  ids = list(chat.render([{"role": "user", "content": question}], tokenizer,
                         add_generation_prompt=True).ids)
  apply = jax.jit(gj.transform(config).apply)
  new = []
  for _ in range(steps):
    token = int(jnp.argmax(apply(params, jnp.asarray([ids + new]))[0, -1]))
    if token in tokenizer.stop_ids:
      break
    new.append(token)
  return tokenizer.decode(new)


@pytest.mark.slow
def test_the_readmes_serve_commands_run_as_written(tmp_path):
  config = tiny("gemma3")
  config.model.vocab_size = 300          # the byte tokenizer's ids
  params = random_params(config)
  gj.hf.save(str(tmp_path / "lora"), config, params)
  serve, curl, client, stop = serve_block()
  assert serve.startswith("python experiments/serve.py --workdir=runs/lora") and stop.startswith("kill %1")
  command = serve.split(" &")[0].replace("--workdir=runs/lora",
                                         f"--hf_dir={tmp_path / 'lora'} --tokenizer=byte")
  server = subprocess.Popen(command.split(), cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, XLA_FLAGS=""))
  try:
    assert "serving lora at http://127.0.0.1:8000/v1" in server.stdout.readline()
    tokenizer = tokenizers.get_tokenizer("byte", config.model.vocab_size)
    want = greedy_reply(config, params, tokenizer, "What is 12 plus 30?", 32)
    answer = subprocess.run(curl, shell=True, capture_output=True, text=True, check=True,
                            timeout=120).stdout
    assert json.loads(answer)["choices"][0]["message"]["content"] == want
    printed = subprocess.run(client.replace("python", sys.executable, 1), shell=True,
                             capture_output=True, text=True, check=True, timeout=120).stdout
    assert printed == want + "\n"
  finally:
    server.send_signal(signal.SIGTERM)
    code = server.wait(timeout=120)
  assert code in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
