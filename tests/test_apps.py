"""gemma_jax.apps through tests/apps_fixture.py, run as its own process: a bad --config
file or override is one stderr line and exit status 2; --help lists the config's
fields and exits 0; absl's flag errors and UsageError are kept; INFO logging (JAX's backend probing too) only with --verbosity;
compiled programs are kept for the next run (--compilation_cache_dir)."""

import os
import re
import subprocess
import sys

import pytest

import gemma_jax as gj
from gemma_jax import apps

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
FIXTURE = os.path.join(os.path.dirname(__file__), "apps_fixture.py")
CONFIG = "--config=configs/gemma3_tiny.py"   # train.steps is 500 there
INFO_LINE = re.compile(r"^I\d{4} ", re.MULTILINE)   # absl's INFO prefix: I, then mmdd


def fixture(*flags, env=None):
  """(exit status, stdout, stderr) of the fixture app run from the repository root, in
  this process's environment with `env` on top (a None value unsets the variable)."""
  env = {key: value for key, value in {**os.environ, "XLA_FLAGS": "", **(env or {})}.items()
         if value is not None}
  result = subprocess.run([sys.executable, FIXTURE, *flags], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, env=env, check=False)
  return result.returncode, result.stdout, result.stderr


def test_a_misspelt_field_is_one_line_with_a_suggestion():
  assert fixture(CONFIG, "--config.train.stepz=20") == (2, "", (
      "apps_fixture.py: error: --config.train.stepz: config.train has no field 'stepz'; "
      "did you mean 'steps'?\n"))


def test_a_misspelt_section_is_one_line_with_a_suggestion():
  assert fixture(CONFIG, "--config.trian.steps=1") == (2, "", (
      "apps_fixture.py: error: --config.trian.steps: config has no field 'trian'; "
      "did you mean 'train'?\n"))


def test_a_field_with_no_close_name_lists_the_fields():
  fields = ", ".join(sorted(gj.get_config("gemma3-tiny").train))
  assert fixture(CONFIG, "--config.train.xyzzy=1") == (2, "", (
      "apps_fixture.py: error: --config.train.xyzzy: config.train has no field 'xyzzy'; "
      f"its fields are {fields}\n"))


@pytest.mark.slow
def test_a_value_of_the_wrong_type_is_one_line():
  assert fixture(CONFIG, "--config.train.steps=abc") == (2, "", (
      "apps_fixture.py: error: --config.train.steps: expects an int, got 'abc'\n"))
  assert fixture(CONFIG, "--config.train.steps.every=1") == (2, "", (
      "apps_fixture.py: error: --config.train.steps.every: config.train.steps is an int, "
      "not a section with fields\n"))


@pytest.mark.slow
def test_a_config_file_that_does_not_load_is_one_line(tmp_path):
  assert fixture("--config=configs/missing.py", "--config.train.steps=1") == (2, "", (
      "apps_fixture.py: error: --config=configs/missing.py: no such file\n"))
  assert fixture("--config=configs/missing.py") == (2, "", (
      "apps_fixture.py: error: --config=configs/missing.py: no such file\n"))
  broken = tmp_path / "broken.py"
  broken.write_text("def get_config():\n  return undefined_name\n")
  assert fixture(f"--config={broken}") == (2, "", (
      f"apps_fixture.py: error: --config={broken}: NameError: "
      "name 'undefined_name' is not defined\n"))


@pytest.mark.slow
def test_a_correct_override_reaches_main_and_the_console_stays_quiet():
  status, out, err = fixture(CONFIG, "--config.train.steps=7")
  assert (status, out, err) == (0, "steps=7 on cpu\n", "")


@pytest.mark.slow
def test_verbosity_brings_back_info_lines():
  status, out, err = fixture(CONFIG, "--verbosity=0")
  assert (status, out) == (0, "steps=500 on cpu\n")
  assert "fixture info line" in err
  assert "backend 'tpu'" in err   # JAX's probing, logged at INFO
  assert len(INFO_LINE.findall(err)) >= 2


def test_help_lists_the_configs_fields_and_succeeds():
  """absl's --help exited 1 and listed no config field: now its text, then every field
  with the config file's value and what the schema says it means, and status 0."""
  status, out, _ = fixture(CONFIG, "--help")
  assert status == 0 and "--config: Experiment config file." in out
  assert "as configs/gemma3_tiny.py sets them:" in out
  assert "  train.steps = 500  # optimizer steps in the whole run\n" in out
  assert "  model.remat_policy = 'none'  # name from gemma_jax.remat.POLICIES" in out
  fields = {line.split(" = ")[0].strip() for line in out.splitlines()
            if line.startswith("  ") and " = " in line}
  assert len(fields) == len(list(apps._fields(gj.default_config())))
  status, out, _ = fixture("--helpfull")   # no config file: the schema's defaults
  assert status == 0 and "as the schema sets them:" in out and "  train.steps = 1000" in out


def test_train_runs_the_tiny_config_when_none_is_given():
  """The README calls configs/gemma3_tiny.py the default; leaving --config out was a
  fatal flag error."""
  result = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "train.py"),
                           "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          check=False)
  assert result.returncode == 0, result.stderr
  assert re.search(r"as \S*configs/gemma3_tiny\.py sets them:", result.stdout)


@pytest.mark.slow
def test_absl_behaviour_is_kept():
  status, _, err = fixture(CONFIG, "--stepz=3")
  assert status == 1 and err.startswith("FATAL Flags parsing error: Unknown command line "
                                        "flag 'stepz'")
  status, _, err = fixture()
  assert status == 1 and "Flag --config must have a value other than None." in err
  status, _, err = fixture(CONFIG, "surplus")   # main raises app.UsageError
  assert status == 1 and err.rstrip().endswith("unexpected arguments: ['surplus']")


@pytest.mark.slow
def test_a_second_run_loads_the_compiled_program_from_the_cache(tmp_path):
  cache = tmp_path / "xla"
  runs = [fixture(CONFIG, "--compile", f"--compilation_cache_dir={cache}") for _ in range(2)]
  assert runs == [(0, f"steps=500 on cpu\ncache={cache} loaded={loaded}\n", "")
                  for loaded in (False, True)]
  assert any(cache.iterdir())


@pytest.mark.slow
def test_the_default_cache_is_jax_s_own_setting_else_under_the_user_cache(tmp_path):
  own = tmp_path / "own"
  assert fixture(CONFIG, "--compile", env={"JAX_COMPILATION_CACHE_DIR": str(own)}) == (
      0, f"steps=500 on cpu\ncache={own} loaded=False\n", "")
  default = tmp_path / "cache_home" / "gemma_jax" / "xla"
  env = {"JAX_COMPILATION_CACHE_DIR": None, "XDG_CACHE_HOME": str(tmp_path / "cache_home")}
  assert [fixture(CONFIG, "--compile", env=env) for _ in range(2)] == [
      (0, f"steps=500 on cpu\ncache={default} loaded={loaded}\n", "")
      for loaded in (False, True)]
  assert any(own.iterdir())


@pytest.mark.slow
def test_an_empty_cache_dir_turns_the_cache_off(tmp_path):
  env = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path)}
  assert [fixture(CONFIG, "--compile", "--compilation_cache_dir=", env=env)
          for _ in range(2)] == [(0, "steps=500 on cpu\ncache=None loaded=False\n", "")] * 2
  assert not any(tmp_path.iterdir())


def test_a_ctrl_c_swallowed_by_a_callback_still_stops_the_app():
  """A KeyboardInterrupt raised where Python ignores exceptions (a __del__, JAX's garbage
  collector callback) reaches the app's unraisable hook, which delivers it again. Done
  inside the hook it was raised there and swallowed too, and the run went on training."""
  program = (
      "import sys, time\n"
      "from gemma_jax import apps\n"
      "sys.unraisablehook = apps._interrupt_again\n"
      "class Swallowed:\n"
      "  def __del__(self):\n"
      "    raise KeyboardInterrupt\n"
      "try:\n"
      "  Swallowed()\n"
      "  deadline = time.time() + 5\n"
      "  while time.time() < deadline:\n"
      "    pass\n"
      "  print('went on')\n"
      "except KeyboardInterrupt:\n"
      "  print('stopped')\n")
  result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          cwd=ROOT, timeout=60, check=False)
  assert result.stdout == "stopped\n", (result.stdout, result.stderr)
