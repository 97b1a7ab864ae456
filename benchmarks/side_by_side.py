r"""gemma_jax against transformers' PyTorch Gemma 3 and Gemma 4, same weights, same machine.

    python benchmarks/side_by_side.py                          # both shapes, table + JSON
    python benchmarks/side_by_side.py --shapes=gemma3 --batch_size=4 --seq_len=256
    python benchmarks/side_by_side.py --torch=false --shapes=gemma3-1b --dtype=bfloat16 \
        --attention_kernel=jax --batch_size=4 --seq_len=2048        # the GPU MFU run

For each shape it builds our model, writes it with `gj.hf.save` and loads that directory
into transformers (so both run the very same weights; the logits' max difference is
printed as a check), then times, alternating ours and theirs round by round:

- train step: forward, cross-entropy, backward, global-norm clipping and AdamW (ours: the
  jitted `gemma_jax.training.steps` train step with donated state; theirs: eager PyTorch);
- forward: logits of a [B, T] batch (ours: `apply`; theirs: under `torch.no_grad`);
- greedy decoding: prefill a [B, P] prompt, then N tokens with the KV cache (ours:
  `sampler.generate`, one jitted while loop; theirs: `generate(do_sample=False)`).

`--library_path` times what a user's own loop does instead of our training stack: a
`jax.jit` of `jax.value_and_grad` over `gj.transform(config).apply` and the
cross-entropy, with optax's clipped AdamW, no donation, nothing else called.

`--lora_rank=r` times LoRA fine-tuning, the route most users take, in the same way: rank-r
adapters on `config.lora.targets` (attention and MLP projections), the base frozen.
Ours: a user's loop, `jax.value_and_grad` over the adapters of
`gj.transform(config).apply(lora.combine(base, adapters), ...)`, optax's clipped AdamW
over the adapters, `jax.jit`. Theirs: peft's `PeftModel.from_pretrained` of our adapters
written by `gemma_jax.peft_adapters.save` (B made nonzero, so that the logits check covers
the adapters' mapping), AdamW over its trainable parameters. The forward pass runs the
adapters unmerged on both sides; decoding is not timed (one merges before serving).

Peak memory is `benchmarks/peak_memory.py`'s: each side in a process of its own.

Both run in one process, so the host-memory setting `import gemma_jax` makes on a CPU
(`gemma_jax.host_memory`; GEMMA_JAX_KEEP_FREED_MEMORY=0 turns it off) applies to both:
glibc's malloc reuses freed memory instead of faulting fresh pages in, which speeds up
ours and theirs.

MFU = tokens/s x model FLOPs per token / the FLOP/s of a square matmul (2048 on a CPU)
timed in the same alternating rounds as the train steps, so that a shared machine's slow
and fast phases fall on the peak as on the steps (`gemma_jax.training.flops`).
`--torch=false` times ours alone, e.g. a real preset on an accelerator.
"""

import os
import tempfile
from typing import Optional

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

import common
import gemma_jax as gj
from gemma_jax import host_memory, lora
from gemma_jax.checkpoints import peft_adapters
from gemma_jax.inference import decoding, sampler
from gemma_jax.training import data, flops, optimizer, steps

_SHAPES = flags.DEFINE_list("shapes", ["gemma3", "gemma4-moe"],
                            f"Shapes: {sorted(common.SHAPES)} or preset names.")
_BATCH = flags.DEFINE_integer("batch_size", 4, "Rows of the train and forward batches.")
_SEQ = flags.DEFINE_integer("seq_len", 512, "Tokens per row of the train and forward batches.")
_DECODE_BATCH = flags.DEFINE_integer("decode_batch_size", 1, "Prompts decoded together.")
_PROMPT = flags.DEFINE_integer("prompt_len", 32, "Prompt tokens P.")
_NEW = flags.DEFINE_integer("new_tokens", 128, "Greedy tokens N decoded after the prompt.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Timed rounds (ours, then theirs) per measurement.")
_DTYPE = flags.DEFINE_string("dtype", "float32", "Compute dtype of ours (theirs: float32).")
_REMAT = flags.DEFINE_string("remat_policy", "none", "Our remat policy.")
_KERNEL = flags.DEFINE_string("attention_kernel", "einsum",
                              "Our attention kernel: einsum, or jax (cuDNN's on a GPU).")
_TORCH = flags.DEFINE_bool("torch", True, "Also time transformers' PyTorch model.")
_LIBRARY_PATH = flags.DEFINE_bool(
    "library_path", False, "Time a user's own loop (apply under jax.value_and_grad, optax "
    "AdamW, jax.jit) instead of gemma_jax.training's train step.")
_LORA_RANK = flags.DEFINE_integer(
    "lora_rank", 0, "Time LoRA fine-tuning at this adapter rank (ours: a user's loop over "
    "the adapters; theirs: peft); 0: full fine-tuning.")
_OUT = flags.DEFINE_string("out", None, "JSON output; default "
                           "benchmarks/results/<script>_<backend>.json.")


def model_config(name: str):
  config = common.shape_config(name)
  config.model.dtype = _DTYPE.value
  config.model.remat_policy = _REMAT.value
  config.model.attention_kernel = _KERNEL.value
  config.optimizer.warmup_steps = 0
  config.lora.rank = _LORA_RANK.value
  return config


def random_tokens(vocab_size: int, shape, seed: int) -> np.ndarray:
  return np.random.default_rng(seed).integers(3, vocab_size, shape).astype(np.int32)


class Ours:
  """Our train step, forward and greedy decoding, each a blocking call."""

  def __init__(self, config, tokens: np.ndarray, prompts: np.ndarray):
    self.config = config
    self.model = gj.transform(config)
    self.tokens = jnp.asarray(tokens)
    self.prompts, self.lengths = jnp.asarray(prompts), jnp.full(prompts.shape[:1],
                                                                 prompts.shape[1], jnp.int32)
    self._decoding = decoding.make_decoding(config)
    self.setup_training()

  def setup_training(self):
    schedule = optimizer.learning_rate_schedule(self.config.optimizer, 1000)
    tx = optimizer.make_optimizer(self.config.optimizer, schedule)
    self.state = steps.init_state(self.model, tx, seed=0, seq_len=self.tokens.shape[1])
    tokens = np.asarray(self.tokens)
    self.batch = jax.device_put(data.make_batch(tokens, np.ones_like(tokens)))
    self._train = jax.jit(steps.make_train_step(steps.model_forward(self.model), tx, schedule),
                          donate_argnums=0)

  @property
  def params(self):
    """The latest parameters (the train step donates the state it is given)."""
    return self.state.params

  def train_step(self):
    self.state, metrics = self._train(self.state, self.batch)
    return float(metrics["loss"])

  def lowered_train_step(self) -> jax.stages.Lowered:
    return self._train.lower(self.state, self.batch)

  def forward(self):
    return jax.block_until_ready(self.model.apply(self.params, self.tokens))

  def greedy(self) -> np.ndarray:
    return np.asarray(sampler.generate(
        self._decoding, self.params, self.prompts, self.lengths, jax.random.key(0),
        jnp.zeros((0,), jnp.int32), max_new_tokens=_NEW.value,
        cache_length=self.prompts.shape[1] + _NEW.value - 1,
        cache_dtype=decoding.default_cache_dtype(self.config)))


class UserLoop(Ours):
  """Ours as a user's own program runs it: the library's `init` and `apply`, optax, and
  `jax.jit`; no train step, no donation, no special calls. It trains all parameters;
  `trainable` and `combine` say what a subclass trains instead."""

  def setup_training(self):
    model, o = self.model, self.config.optimizer
    self.tx = optax.chain(optax.clip_by_global_norm(o.max_grad_norm),
                          optax.adamw(o.learning_rate, b1=o.b1, b2=o.b2, eps=o.eps,
                                      weight_decay=o.weight_decay))
    self.frozen, self.trained = self.trainable(model.init(jax.random.key(0), self.tokens))
    self.opt_state = self.tx.init(self.trained)
    combine = self.combine

    def loss(trained, frozen, tokens):
      logits = model.apply(combine(frozen, trained), tokens)
      return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1],
                                                             tokens[:, 1:]).mean()

    @jax.jit
    def step(trained, opt_state, frozen, tokens):
      value, grads = jax.value_and_grad(loss)(trained, frozen, tokens)
      updates, opt_state = self.tx.update(grads, opt_state, trained)
      return optax.apply_updates(trained, updates), opt_state, value

    self._step = step

  @staticmethod
  def trainable(params):
    """params -> (frozen, trained)."""
    return {}, params

  @staticmethod
  def combine(frozen, trained):
    """`trainable` undone: the parameters `apply` takes."""
    del frozen
    return trained

  @property
  def params(self):
    return self.combine(self.frozen, self.trained)

  def train_step(self):
    self.trained, self.opt_state, value = self._step(self.trained, self.opt_state,
                                                     self.frozen, self.tokens)
    return float(value)

  def lowered_train_step(self) -> jax.stages.Lowered:
    return self._step.lower(self.trained, self.opt_state, self.frozen, self.tokens)


class UserLoraLoop(UserLoop):
  """A user's LoRA loop: the base frozen (an argument of the jitted step, as a user
  passes it), gradients and AdamW for the adapters only."""

  @staticmethod
  def trainable(params):
    base, adapters = lora.split(params)
    # B starts at zero; a small random B makes the adapters change the logits.
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(adapters))))
    return base, jax.tree_util.tree_map_with_path(
        lambda path, x: (0.02 * jax.random.normal(next(keys), x.shape, x.dtype)
                         if path[-1].key == "lora_b" else x), adapters)

  combine = staticmethod(lora.combine)

  def save(self, path: str) -> str:
    """Writes the base as a transformers directory and the adapters as a peft one
    (`path`/adapter); returns the latter."""
    gj.hf.save(path, lora.disabled(self.config), self.frozen)
    adapter_dir = os.path.join(path, "adapter")
    peft_adapters.save(adapter_dir, self.config, self.trained)
    return adapter_dir


class Theirs:
  """transformers' model loaded from our checkpoint: the same three calls, eager PyTorch."""

  def __init__(self, path: str, config, tokens: np.ndarray, prompts: np.ndarray,
               adapter_dir: Optional[str] = None):
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel
    self.torch = torch
    self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if adapter_dir:   # peft freezes the base: only the adapters require gradients
      import peft  # pylint: disable=import-outside-toplevel
      self.model = peft.PeftModel.from_pretrained(self.model, adapter_dir, is_trainable=True)
    self.trained = [p for p in self.model.parameters() if p.requires_grad]
    o = config.optimizer
    self.optimizer = torch.optim.AdamW(self.trained, lr=o.learning_rate,
                                       betas=(o.b1, o.b2), eps=o.eps,
                                       weight_decay=o.weight_decay)
    self.max_grad_norm = o.max_grad_norm
    self.tokens = torch.as_tensor(tokens, dtype=torch.long)
    self.prompts = torch.as_tensor(prompts, dtype=torch.long)

  def train_step(self):
    torch = self.torch
    self.model.train()
    logits = self.model(self.tokens).logits
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), self.tokens[:, 1:].reshape(-1))
    loss.backward()
    if self.max_grad_norm:
      torch.nn.utils.clip_grad_norm_(self.trained, self.max_grad_norm)
    self.optimizer.step()
    self.optimizer.zero_grad(set_to_none=True)
    return loss.item()

  def forward(self):
    self.model.eval()
    with self.torch.no_grad():
      return self.model(self.tokens).logits

  def greedy(self) -> np.ndarray:
    self.model.eval()
    with self.torch.no_grad():
      out = self.model.generate(self.prompts, attention_mask=self.torch.ones_like(self.prompts),
                                do_sample=False, max_new_tokens=_NEW.value,
                                min_new_tokens=_NEW.value, pad_token_id=0)
    return out[:, self.prompts.shape[1]:].numpy()


def leading_agreement(a: np.ndarray, b: np.ndarray) -> int:
  """Tokens every row agrees on before the first difference."""
  differs = a != b
  return int(np.min(np.where(differs.any(axis=1), differs.argmax(axis=1), a.shape[1])))


def run_shape(name: str) -> dict:
  """The measurements of one shape."""
  config = model_config(name)
  m = config.model
  b, t = _BATCH.value, _SEQ.value
  tokens = random_tokens(m.vocab_size, (b, t), seed=0)
  prompts = random_tokens(m.vocab_size, (_DECODE_BATCH.value, _PROMPT.value), seed=1)
  tuning = _LORA_RANK.value > 0
  loop = UserLoraLoop if tuning else UserLoop if _LIBRARY_PATH.value else Ours
  ours = loop(config, tokens, prompts)
  result = {"shape": name, "model": {k: v for k, v in m.to_dict().items() if k != "vision"},
            "batch_size": b, "seq_len": t, "decode_batch_size": _DECODE_BATCH.value,
            "prompt_len": _PROMPT.value, "new_tokens": _NEW.value,
            "lora": config.lora.to_dict() if tuning else None}
  calls = {"ours": ours}
  if _TORCH.value:
    with tempfile.TemporaryDirectory() as path:
      adapter_dir = ours.save(path) if tuning else gj.hf.save(path, config, ours.params)
      calls["theirs"] = Theirs(path, config, tokens, prompts, adapter_dir)
    theirs_logits = calls["theirs"].forward().numpy()
    result["max_logit_difference"] = float(np.abs(np.asarray(ours.forward()) - theirs_logits).max())
    if not tuning:
      result["greedy_tokens_agreeing"] = leading_agreement(ours.greedy(),
                                                           calls["theirs"].greedy())

  rounds = _ROUNDS.value
  size = 2048 if jax.default_backend() == "cpu" else 8192
  peak_matmul, peak_flop = flops.square_matmul(size, _DTYPE.value)
  train = common.alternating_medians(
      {"peak": peak_matmul, **{k: c.train_step for k, c in calls.items()}}, rounds)
  peak = result["peak_flops"] = peak_flop / train["peak"]
  forward = common.alternating_medians({k: c.forward for k, c in calls.items()}, rounds)
  greedy = ({} if tuning else common.alternating_medians(
      {k: c.greedy for k, c in calls.items()}, max(2, rounds // 2)))
  forward_flops_per_token = flops.training_flops_per_token(m, t) / 3
  flops_per_token = flops.training_flops_per_token(m, t, lora.param_count(config))
  for who in calls:
    result[who] = {
        "train_step_s": train[who], "train_tokens_per_s": b * t / train[who],
        "train_mfu": b * t / train[who] * flops_per_token / peak,
        "train_step_minor_page_faults": common.minor_page_faults(calls[who].train_step),
        "forward_s": forward[who], "forward_tokens_per_s": b * t / forward[who],
        "forward_mfu": b * t / forward[who] * forward_flops_per_token / peak,
        "greedy_s": greedy.get(who),
        "decode_tokens_per_s": _DECODE_BATCH.value * _NEW.value / greedy[who]
                               if who in greedy else None}
  if _TORCH.value:
    result["ratio_ours_over_theirs"] = {
        "train_tokens_per_s": train["theirs"] / train["ours"],
        "forward_tokens_per_s": forward["theirs"] / forward["ours"],
        "decode_tokens_per_s": greedy["theirs"] / greedy["ours"] if greedy else None}
  return result


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  kept = os.environ.get(host_memory.OPT_OUT) != "0" and not host_memory.accelerator_installed()
  results = []
  for name in _SHAPES.value:
    result = run_shape(name)
    results.append(result)
    if "max_logit_difference" in result:
      agreeing = (f"; greedy tokens agreeing: {result['greedy_tokens_agreeing']}/{_NEW.value}"
                  if "greedy_tokens_agreeing" in result else "")
      print(f"{name}: same weights{' and adapters' if _LORA_RANK.value else ''}, max |logit "
            f"difference| {result['max_logit_difference']:.2e}{agreeing}", flush=True)

  rows = []
  for r in results:
    for who in ("ours", "theirs"):
      if who in r:
        x = r[who]
        rows.append([r["shape"], who, x["train_tokens_per_s"], f"{x['train_mfu']:.1%}",
                     x["forward_tokens_per_s"], x["decode_tokens_per_s"] or "",
                     r["peak_flops"] / 1e9, x["train_step_minor_page_faults"]])
    if "ratio_ours_over_theirs" in r:
      q = r["ratio_ours_over_theirs"]
      rows.append([r["shape"], "ours / theirs", f"{q['train_tokens_per_s']:.2f}x", "",
                   f"{q['forward_tokens_per_s']:.2f}x",
                   f"{q['decode_tokens_per_s']:.2f}x" if q["decode_tokens_per_s"] else "", "", ""])
  common.print_table(
      f"batch {_BATCH.value} x {_SEQ.value} (train, forward); decode {_DECODE_BATCH.value} x "
      f"({_PROMPT.value} prompt + {_NEW.value} greedy); {_DTYPE.value}",
      ["shape", "who", "train tok/s", "train MFU", "forward tok/s", "decode tok/s",
       "matmul peak GFLOP/s", "page faults / train step"], rows)
  common.write_json(common.output_path(_OUT.value, "side_by_side"),
                    {"dtype": _DTYPE.value, "attention_kernel": _KERNEL.value,
                     "remat_policy": _REMAT.value, "keep_freed_host_memory": kept,
                     "library_path": _LIBRARY_PATH.value, "lora_rank": _LORA_RANK.value,
                     "results": results})


if __name__ == "__main__":
  app.run(main)
