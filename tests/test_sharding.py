"""Sharding on 8 simulated CPU devices (tests/conftest.py): meshes from the config,
sharded training equal to one device, FSDP memory, checkpoints across meshes, the app,
two processes under jax.distributed, and memory planning."""

import contextlib
import functools
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gemma_jax as gj
from gemma_jax import planning, sharding
from gemma_jax.layers import chunked_loss, grouped_mlp
from gemma_jax.training import checkpoints, data, metrics, steps
from test_training import REPO, write_config_file

MODEL = dict(vocab_size=260, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
             num_layers=3, attention_pattern=("local", "global"), sliding_window=5)
MESHES = {
    "data8": dict(data=8),
    "fsdp8": dict(data=1, fsdp=8),
    "fsdp4_tensor2": dict(data=1, fsdp=4, tensor=2),
    "data2_fsdp2_tensor2": dict(data=2, fsdp=2, tensor=2),
}


# Gemma 4 with 4 experts, top 2, and both auxiliary losses.
MOE_MODEL = dict(MODEL, num_layers=2, global_head_dim=16, global_num_kv_heads=1, mlp_dim=32,
                 num_experts=4, experts_per_token=2, expert_mlp_dim=16,
                 load_balance_loss_weight=0.01, router_z_loss_weight=1e-3)
MOE_MESHES = {
    "expert4_data2": dict(data=2, expert=4),
    "expert4_fsdp2": dict(data=1, fsdp=2, expert=4),
}


def config_with(mesh=None, **model):
  config = gj.get_config("gemma3-tiny")
  config.model.update(dict(MODEL, **model))
  config.mesh.update(mesh or {})
  return config


def batches(n=5, b=8, t=16):
  rng = np.random.default_rng(0)
  segment_ids = np.sort(rng.integers(1, 3, (n, b, t)), axis=-1)
  return [data.make_batch(rng.integers(3, 259, (b, t)).astype(np.int32), segment_ids[i])
          for i in range(n)]


def run_steps(config, mesh=None):
  """Losses and final params of 5 AdamW steps; one device when mesh is None."""
  model = gj.transform(config)
  tx = optax.adamw(1e-2)
  step = steps.make_train_step(steps.model_forward(model), tx, lambda _: 1e-2)
  init = lambda: steps.init_state(model, tx, seed=0, seq_len=16)
  if mesh is None:
    state, step = jax.jit(init)(), jax.jit(step)
    put = lambda batch: batch
  else:
    shardings = steps.state_shardings(config, tx, jax.eval_shape(init), mesh)
    with sharding.activate(mesh):
      state = jax.jit(init, out_shardings=shardings)()
      step = jax.jit(step, in_shardings=(shardings, sharding.batch_sharding(mesh)),
                     out_shardings=(shardings, sharding.replicated(mesh)))
    put = lambda batch: sharding.global_batch(batch, mesh)
  losses = []
  with sharding.activate(mesh) if mesh is not None else contextlib.nullcontext():
    for batch in batches():
      state, step_metrics = step(state, put(batch))
      losses.append(float(step_metrics["loss"]))
  return np.asarray(losses), state


@pytest.fixture(scope="module")
def single_device():
  return run_steps(config_with())


@functools.cache
def sharded_run(name):
  """(losses, final state, mesh) of `run_steps` on the named mesh, run once."""
  mesh = sharding.make_mesh(config_with(MESHES[name]).mesh)
  return (*run_steps(config_with(MESHES[name]), mesh), mesh)


def test_eight_simulated_devices():
  assert jax.device_count() == 8


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MESHES))
def test_sharded_losses_equal_single_device(single_device, name):
  losses, state, mesh = sharded_run(name)
  np.testing.assert_allclose(losses, single_device[0], rtol=1e-5)
  # Adam turns float noise in near-zero gradients into steps of up to lr (1e-2) per
  # update, so the parameters agree to a looser bound than the losses.
  chex.assert_trees_all_close(jax.device_get(state.params), jax.device_get(single_device[1].params),
                              atol=5e-4)
  embedding = state.params["embed"]["embedding"]    # [V, D]: vocab on tensor, embed on fsdp
  sizes = dict(mesh.shape)
  assert embedding.addressable_shards[0].data.shape == (260 // sizes["tensor"],
                                                         32 // sizes["fsdp"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["data8", "data2_fsdp2_tensor2"])
def test_accumulating_micro_batches_stay_on_their_devices(name):
  """Four micro-batches of a 32-row batch on a mesh: each takes a quarter of every
  device's rows, so accumulating moves no row between devices (the compiled step holds
  the same collectives as one step over an 8-row batch; with contiguous micro-batches
  data8 gained 16 collective-permutes and 9 all-gathers, data2_fsdp2_tensor2 5
  all-to-alls), and its update equals one device's over the 32 rows at once."""
  config = config_with(MESHES[name])
  mesh = sharding.make_mesh(config.mesh)
  model = gj.transform(config)
  tx = optax.sgd(1.0)
  init = lambda: steps.init_state(model, tx, seed=0, seq_len=16)
  shardings = steps.state_shardings(config, tx, jax.eval_shape(init), mesh)

  def compiled(accum, batch):
    step = steps.make_train_step(steps.model_forward(model), tx, lambda _: 1.0,
                                 grad_accum_steps=accum)
    with sharding.activate(mesh):
      return jax.jit(step, in_shardings=(shardings, sharding.batch_sharding(mesh)),
                     out_shardings=(shardings, sharding.replicated(mesh))).lower(
                         jax.eval_shape(init), batch).compile()

  collectives = lambda step: sorted(re.findall(
      r" (all-to-all|collective-permute|all-gather|all-reduce|reduce-scatter)(?:-start)?\(",
      step.as_text()))
  batch = batches(n=1, b=32)[0]
  accumulating = compiled(4, batch)
  assert collectives(accumulating) == collectives(compiled(1, batches(n=1, b=8)[0]))
  with sharding.activate(mesh):
    new, _ = accumulating(jax.jit(init, out_shardings=shardings)(),
                          sharding.global_batch(batch, mesh))
  expected, _ = jax.jit(steps.make_train_step(steps.model_forward(model), tx,
                                              lambda _: 1.0))(jax.jit(init)(), batch)
  chex.assert_trees_all_close(jax.device_get(new.params), jax.device_get(expected.params),
                              atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name,table_sum", [("data2_fsdp2_tensor2", "platform"),
                                            ("fsdp4_tensor2", "platform"),
                                            ("fsdp4_tensor2", "off_cpu")])
def test_chunked_loss_on_a_mesh_equals_single_device(single_device, name, table_sum,
                                                     monkeypatch):
  """The loss over 4 chunks of 4 positions, batch and vocabulary sharded, against the
  single device's whole logits; "off_cpu": the chunks as off a CPU (the table gradient
  summed as [V, D], the log-normalisers in one reduction over the sharded vocabulary)."""
  monkeypatch.setattr(chunked_loss, "LOGITS_BYTES", 4 * 8 * 260 * 4)
  if table_sum == "off_cpu":
    monkeypatch.setattr(chunked_loss, "_scan_with_table_gradient",
                        lambda *a: chunked_loss._scan_chunks(*a, on_cpu=False))
  assert chunked_loss.chunk_length(8, 16, 260) == 4
  mesh = sharding.make_mesh(config_with(MESHES[name]).mesh)
  losses, state = run_steps(config_with(MESHES[name]), mesh)
  np.testing.assert_allclose(losses, single_device[0], rtol=1e-5)
  chex.assert_trees_all_close(jax.device_get(state.params),
                              jax.device_get(single_device[1].params), atol=5e-4)


def moe_config(mesh=None):
  config = gj.get_config("gemma4-moe-tiny")
  config.model.update(MOE_MODEL)
  config.mesh.update(mesh or {})
  return config


@pytest.fixture(scope="module")
def single_device_moe():
  return run_steps(moe_config())


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MOE_MESHES))
def test_expert_parallel_losses_equal_single_device(single_device_moe, name):
  config = moe_config(MOE_MESHES[name])
  mesh = sharding.make_mesh(config.mesh)
  losses, state = run_steps(config, mesh)
  np.testing.assert_allclose(losses, single_device_moe[0], rtol=1e-5)
  gate = state.params["blocks"]["layer_0"]["moe"]["experts"]["gate"]  # [blocks, E, D, F]
  assert gate.addressable_shards[0].data.shape[:2] == (1, 1)           # E over expert=4


def expert4_data2_forward(tokens: jax.ShapeDtypeStruct):
  """(the MoE model's config, its forward under expert=4 x data=2 lowered for `tokens`)."""
  config = moe_config(MOE_MESHES["expert4_data2"])
  mesh = sharding.make_mesh(config.mesh)
  model = gj.transform(config)
  params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 16), jnp.int32))
  with sharding.activate(mesh):
    return config, jax.jit(lambda p, t: model.apply(p, t),
                           in_shardings=(sharding.param_shardings(config, mesh),
                                         sharding.batch_sharding(mesh))).lower(params, tokens)


def test_expert_parallel_moves_tokens_not_expert_weights():
  """Under expert=4 x data=2 each device runs its own expert: the compiled forward
  all-gathers tokens and reduce-scatters outputs, and never gathers the [E, D, F]
  expert weights onto one device (what the compiler does without `expert_parallel`)."""
  config, lowered = expert4_data2_forward(jax.ShapeDtypeStruct((8, 16), jnp.int32))
  hlo = lowered.compile().as_text()
  gathered = re.findall(r"= (\S+) all-gather\(", hlo)
  m = config.model
  whole_experts = {f"f32[{m.num_experts},{m.d_model},{m.expert_mlp_dim}]",
                   f"f32[{m.num_experts},{m.expert_mlp_dim},{m.d_model}]"}
  assert gathered and not [s for s in gathered if s.split("{")[0] in whole_experts], gathered
  assert "reduce-scatter(" in hlo


def test_expert_parallel_loop_sizes_its_batch_for_its_own_rows():
  """On the CPU each device's loop dispatch gets every assignment of its expert group
  (all-gathered) but is routed about 1 / P of them: its batched product holds the
  capacity for those, not for all (which would multiply P times the rows it needs)."""
  tokens = jax.ShapeDtypeStruct((8, 16), jnp.int32)
  config, lowered = expert4_data2_forward(tokens)
  text, m = lowered.as_text(), config.model
  # A device's expert group all-gathers B x T / data tokens; 1 / expert of their
  # assignments are routed to its expert, on average.
  per_device = tokens.shape[0] * tokens.shape[1] * m.experts_per_token // (2 * 4)
  batched = lambda rows: f"tensor<1x{grouped_mlp.capacity(rows, 1)}x{m.expert_mlp_dim}xf32>"
  assert batched(per_device) in text
  assert batched(4 * per_device) not in text


def test_fsdp8_device_holds_an_eighth_plus_small_vectors():
  config = config_with(MESHES["fsdp8"])
  mesh = sharding.make_mesh(config.mesh)
  with sharding.activate(mesh):
    params = jax.jit(gj.transform(config).init,
                     out_shardings=sharding.param_shardings(config, mesh))(
                         jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  leaves = jax.tree.leaves(params)
  total = sum(leaf.nbytes for leaf in leaves)
  replicated = [leaf for leaf in leaves if leaf.sharding.is_fully_replicated]
  assert all(leaf.ndim <= 2 and leaf.shape[-1] <= 32 for leaf in replicated)   # norm scales
  small = sum(leaf.nbytes for leaf in replicated)
  assert small < total / 50
  for device in jax.devices():
    held = sum(shard.data.nbytes for leaf in leaves for shard in leaf.addressable_shards
               if shard.device == device)
    assert held <= total / 8 + small, (device, held, total)


def test_mesh_errors_name_the_axis():
  with pytest.raises(gj.ConfigError, match=r"-1 takes the devices left over, but the other "
                     r"axes \(fsdp=3, tensor=1, expert=1: 3 ways\) do not divide the 8 "
                     "devices") as error:
    sharding.mesh_shape(config_with(dict(fsdp=3)).mesh, 8)
  assert error.value.field == "mesh.data"
  with pytest.raises(gj.ConfigError, match="span 4 devices, but there are 8"):
    sharding.mesh_shape(config_with(dict(data=2, fsdp=2)).mesh, 8)
  with pytest.raises(gj.ConfigError, match="only one mesh axis may be -1 .* e.g. mesh.data=1"
                     ) as error:
    gj.validate(config_with(dict(fsdp=-1)))
  assert error.value.field == "mesh.fsdp"
  with pytest.raises(gj.ConfigError, match="positive integer or -1") as error:
    gj.validate(config_with(dict(tensor=0)))
  assert error.value.field == "mesh.tensor"
  assert sharding.mesh_shape(config_with(dict(tensor=2)).mesh, 8) == dict(
      data=4, fsdp=1, tensor=2, expert=1)


def test_indivisible_dimension_names_parameter_and_axis():
  config = config_with(dict(data=1, tensor=8))
  with pytest.raises(gj.ConfigError, match=r"parameter blocks/layer_0/attn/k/kernel dimension 2 "
                     r"\(kv_heads\) has size 2, which mesh axes \('tensor',\) \(8 ways\)"
                     ) as error:
    sharding.param_specs(config, sharding.mesh_shape(config.mesh, 8))
  assert error.value.field == "mesh.tensor"
  with pytest.raises(gj.ConfigError, match="6 rows does not split") as error:
    sharding.check_batch_rows(6, dict(data=8, fsdp=1, tensor=1, expert=1))
  assert error.value.field == "train.batch_size"


def test_checkpoint_saved_under_fsdp8_restores_into_data4_tensor2(tmp_path):
  _, state, _ = sharded_run("fsdp8")
  checkpointer = checkpoints.Checkpointer(str(tmp_path), keep=1)
  checkpointer.save(state, {"next_batch": 5})
  checkpointer.wait()

  config = config_with(dict(data=4, tensor=2))
  mesh = sharding.make_mesh(config.mesh)
  model, tx = gj.transform(config), optax.adamw(1e-2)
  init = lambda: steps.init_state(model, tx, seed=0, seq_len=16)
  shardings = steps.state_shardings(config, tx, jax.eval_shape(init), mesh)
  like = jax.eval_shape(jax.jit(init, out_shardings=shardings))
  restored, data_state = checkpointer.restore(like)
  checkpointer.close()
  assert data_state == {"next_batch": 5}
  chex.assert_trees_all_equal(jax.device_get(restored.params), jax.device_get(state.params))
  chex.assert_trees_all_equal(jax.device_get(restored.opt_state),
                              jax.device_get(state.opt_state))
  for array, target in zip(jax.tree.leaves(restored), jax.tree.leaves(shardings)):
    assert array.sharding.is_equivalent_to(target, array.ndim)
  q_kernel = restored.params["layers_2"]["attn"]["q"]["kernel"]   # [D, N, H], N on tensor
  assert q_kernel.addressable_shards[0].data.shape == (32, 2, 8)


def run_app(config_file, workdir, *flags, **popen):
  return subprocess.Popen(
      [sys.executable, os.path.join(REPO, "experiments", "train.py"), f"--config={config_file}",
       f"--workdir={workdir}", "--config.model.num_kv_heads=2", *flags], cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


@pytest.fixture(scope="module")
def app_run(tmp_path_factory, corpus):
  """experiments/train.py for 3 steps under fsdp=4 x tensor=2: (config file, losses)."""
  directory = tmp_path_factory.mktemp("app")
  config_file = write_config_file(directory, corpus, 3)
  process = run_app(config_file, directory / "run", "--config.mesh.fsdp=4",
                    "--config.mesh.tensor=2")
  _, stderr = process.communicate(timeout=300)
  assert process.returncode == 0, stderr
  records = metrics.read_records(str(directory / "run"))
  assert [r["step"] for r in records] == [1, 2, 3]
  return config_file, [r["loss"] for r in records]


@pytest.mark.slow
def test_train_app_runs_under_fsdp4_tensor2(app_run):
  assert all(np.isfinite(app_run[1]))


def free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path, app_run):
  """Two jax.distributed processes of 4 devices each (fsdp=8 across them, each reading
  its half of every batch) log the losses of one process with 8 devices."""
  config_file, single_process_losses = app_run
  env = dict(os.environ, XLA_FLAGS=os.environ["XLA_FLAGS"].replace(
      "--xla_force_host_platform_device_count=8", "--xla_force_host_platform_device_count=4"),
             JAX_COORDINATOR_ADDRESS=f"localhost:{free_port()}", JAX_NUM_PROCESSES="2")
  workers = [run_app(config_file, tmp_path, "--config.mesh.data=1", "--config.mesh.fsdp=8",
                     env=dict(env, JAX_PROCESS_ID=str(i))) for i in range(2)]
  outputs = [worker.communicate(timeout=300) for worker in workers]
  assert [worker.returncode for worker in workers] == [0, 0], outputs
  records = metrics.read_records(str(tmp_path))     # written by process 0 alone
  assert [r["step"] for r in records] == [1, 2, 3]
  np.testing.assert_allclose([r["loss"] for r in records], single_process_losses, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["gemma3-27b"])
def test_plan_params_per_device_on_256_devices(preset):
  config = gj.get_config(preset)
  config.mesh.update(dict(data=1, fsdp=-1))
  plan = planning.plan(config, num_devices=256, batch_size=256, seq_len=4096)
  shapes = jax.eval_shape(gj.transform(config).init, jax.random.key(0),
                          jax.ShapeDtypeStruct((1, 1), jnp.int32))
  leaves = jax.tree_util.tree_leaves_with_path(shapes)
  total = sum(math.prod(s.shape) * 4 for _, s in leaves)
  # Every matrix splits 256 ways on its D=5376 dim; only norm scales stay whole.
  scales = sum(math.prod(s.shape) * 4 for path, s in leaves if path[-1].key == "scale")
  assert plan["mesh"] == dict(data=1, fsdp=256, tensor=1, expert=1)
  assert total / 256 <= plan["params"] <= total / 256 + scales
  assert plan["optimizer_state"] == 2 * plan["params"]
  assert plan["activations"] > 0



@pytest.mark.slow
@pytest.mark.parametrize("policy", ["none", "full"])
def test_planned_activations_track_xla_memory_analysis(policy):
  """The planned activations plus gradients against the temporaries XLA allocates for
  the compiled train step (12 MoE layers with a global head size, 2 x 1024 tokens):
  the plan is an estimate, within 0.4x to 1.5x of XLA's figure."""
  config = gj.get_config("gemma4-moe-tiny")
  config.model.update(num_layers=12, remat_policy=policy)
  config.optimizer.grad_accum_steps = 1
  model = gj.transform(config)
  tx = optax.adamw(1e-3)
  state = jax.eval_shape(lambda: steps.init_state(model, tx, seed=0, seq_len=1024))
  rows = jax.ShapeDtypeStruct((2, 1024), np.int32)
  batch = dict(tokens=rows, segment_ids=rows, positions=rows, targets=rows,
               weights=jax.ShapeDtypeStruct((2, 1024), np.float32))
  step = jax.jit(steps.make_train_step(steps.model_forward(model), tx, lambda _: 1e-3),
                 donate_argnums=0)
  temp = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
  plan = planning.plan(config, 1, 2, 1024)
  assert 0.4 <= (plan["activations"] + plan["gradients"]) / temp <= 1.5

def param_bytes(preset):
  """(all parameter bytes in float32, those of unshardable norm scales)."""
  shapes = jax.eval_shape(gj.transform(gj.get_config(preset)).init, jax.random.key(0),
                          jax.ShapeDtypeStruct((1, 1), jnp.int32))
  leaves = jax.tree_util.tree_leaves_with_path(shapes)
  return (sum(math.prod(s.shape) * 4 for _, s in leaves),
          sum(math.prod(s.shape) * 4 for path, s in leaves if path[-1].key == "scale"))


@pytest.mark.slow
@pytest.mark.parametrize("preset,mesh,expected_mesh", [
    ("gemma4-31b", "fsdp", dict(data=1, fsdp=256, tensor=1, expert=1)),
    ("gemma4-26b-a4b", "expert", dict(data=1, fsdp=64, tensor=1, expert=4)),
])
def test_plan_app_per_device_bytes(tmp_path, preset, mesh, expected_mesh):
  """experiments/plan.py for the largest presets on 256 devices: the mesh preset, and
  parameters, gradients and Adam's two moments split as the mesh says (every matrix
  over fsdp, the experts' also over expert; norm scales whole)."""
  out = tmp_path / "plan.json"
  subprocess.run([sys.executable, os.path.join(REPO, "experiments", "plan.py"),
                  "--config=" + os.path.join(REPO, "configs", "gemma3_1b.py"),
                  f"--preset={preset}", "--devices=256", f"--mesh={mesh}",
                  "--config.train.batch_size=256", "--config.optimizer.grad_accum_steps=1",
                  f"--json={out}"], check=True, cwd=REPO, capture_output=True)
  plan = json.loads(out.read_text())
  total, scales = param_bytes(preset)
  assert plan["mesh"] == expected_mesh
  assert total / 256 <= plan["params"] <= total / expected_mesh["fsdp"] + scales
  assert plan["gradients"] == plan["params"]
  assert plan["optimizer_state"] >= 2 * plan["params"]
  assert 0 < plan["activations"]


@pytest.mark.slow
@pytest.mark.parametrize("flag,message", [
    ("--preset=gemma3-nope", "plan.py: error: unknown preset 'gemma3-nope'"),
    ("--cache_dtype=foo", "--cache_dtype=foo: value should be one of"),
    ("--devices=0", "flag --devices=0: 0 is not a positive integer"),
    ("--devices=-4", "flag --devices=-4: -4 is not a positive integer"),
    ("--cache_batch=0", "flag --cache_batch=0: 0 is not a positive integer"),
])
def test_plan_app_bad_flags_are_one_error_line(flag, message):
  """An unknown preset or cache dtype stops plan.py with one line, not a traceback."""
  run = subprocess.run([sys.executable, os.path.join(REPO, "experiments", "plan.py"),
                        "--config=" + os.path.join(REPO, "configs", "gemma3_1b.py"),
                        "--cache_length=8", flag], cwd=REPO, capture_output=True, text=True)
  assert run.returncode != 0
  assert "Traceback" not in run.stderr
  assert message in run.stderr


def plan_app(*flags):
  """experiments/plan.py with `flags` and --json: the plan it wrote."""
  with tempfile.TemporaryDirectory() as workdir:
    out = os.path.join(workdir, "plan.json")
    run = subprocess.run([sys.executable, os.path.join(REPO, "experiments", "plan.py"), *flags,
                          f"--json={out}"], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    with open(out) as f:
      return json.load(f)


@pytest.mark.slow
def test_plan_app_keeps_model_flags_given_with_a_preset():
  """--config.model.* flags apply on top of --preset: the plan equals planning.plan for
  the preset's model with those fields set."""
  plan = plan_app("--config=" + os.path.join(REPO, "configs", "gemma3_1b.py"),
                  "--preset=gemma3-27b", "--devices=8", "--config.model.num_layers=12",
                  "--config.model.vocab_size=4096")
  config = gj.get_config("gemma3-1b")   # configs/gemma3_1b.py's settings, by hand
  config.model = gj.get_config("gemma3-27b").model
  config.model.update(dtype="bfloat16", remat_policy="save_dot_except_mlp", num_layers=12,
                      vocab_size=4096)
  config.data.seq_len, config.train.batch_size = 1024, 64
  config.optimizer.grad_accum_steps = 8
  expected = planning.plan(config, 8, 64, 1024)
  assert plan["model"] == "gemma3-27b"
  for name in ("params", "gradients", "optimizer_state", "activations"):
    assert plan[name] == expected[name], name


def documented_commands(text: str, script: str) -> list:
  """Each `python experiments/<script> ...` command in `text` (lines joined): its flags."""
  text = re.sub(r"\\\n\s*|\n[ ]+(?=--|experiments/)", " ", text)   # continued lines
  return [line.split()[2:] for line in re.findall(
      rf"python experiments/{script} [^`\"\n]*", text)]


def test_documented_plans_and_multi_host_meshes_are_valid():
  """The plan.py commands in the scaling guide and plan.py's docstring run, and the
  guide's multi-host training flags (gemma3_1b on 32 devices) give a mesh the batch
  splits over."""
  with open(os.path.join(REPO, "docs", "scaling.md")) as f:
    readme = f.read()
  with open(os.path.join(REPO, "experiments", "plan.py")) as f:
    docstring = f.read().split('"""')[1]
  plans = documented_commands(readme, "plan.py") + documented_commands(docstring, "plan.py")
  trains = [flags for flags in documented_commands(readme, "train.py")
            if "--config.mesh.distributed=True" in flags]
  assert len(plans) >= 6 and len(trains) == 2
  for flags in plans:
    plan_app(*flags)
  for flags in trains:
    plan = plan_app("--devices=32", *[f for f in flags if not f.startswith("--workdir")])
    assert math.prod(plan["mesh"].values()) == 32
