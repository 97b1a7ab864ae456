"""What every absl app in experiments/ shares: `run(main)` instead of `absl.app.run(main)`,
and `define_model_flags()` for the apps that run a trained model.

It keeps absl's behaviour (--help, flags, UsageError) and adds four things:
- a bad --config file or --config.* override ends with one line on stderr that names
  the field (`train.py: error: --config.train.stepz: config.train has no field 'stepz';
  did you mean 'steps'?`) and exit status 2, instead of a traceback;
- Ctrl-C ends with one line (`train.py: interrupted`) and exit status 130, as a shell
  reports a command it interrupted, instead of a KeyboardInterrupt traceback;
- the console keeps to what the user asked for: absl, orbax and JAX's INFO lines (JAX's
  backend probing among them) are hidden unless --verbosity is given, and after
  `log_to_file(path)` the libraries' error reports (orbax's tracebacks of a failed
  save) go to that file;
- compiled programs are kept on disk for the next run (`gemma_jax.compilation_cache`;
  --compilation_cache_dir= turns that off).
"""

import _thread
import difflib
import functools
import importlib.machinery
import importlib.util
import logging as python_logging
import os
import re
import signal
import sys
import threading
from typing import Callable, List, NamedTuple, Optional

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_dict
from ml_collections.config_flags import config_flags

from gemma_jax import compilation_cache
from gemma_jax import config as config_lib
from gemma_jax import quant
from gemma_jax.layers import kv_cache
from gemma_jax.training import init_from

FLAGS = flags.FLAGS
USAGE_ERROR = 2   # the exit status of a refused command line, as argparse's
INTERRUPTED = 130   # the exit status of an interrupted command: 128 + SIGINT, as a shell's

_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache_dir", None, "Where compiled programs are kept for the next run; "
    "default: $JAX_COMPILATION_CACHE_DIR if set, else "
    f"{compilation_cache.default_directory()}. Empty: no cache.")
# The flags this module defines from here on (`define_model_flags`) are the calling app's
# own: its --help lists them.
flags.disclaim_key_flags()


def run(main: Callable[[List[str]], object], argv: Optional[List[str]] = None,
        default_config: Optional[str] = None) -> None:
  """absl.app.run(main) with one-line config errors, Ctrl-C as one line and exit status
  130, a quiet console and the compilation cache on. Files being written when Ctrl-C
  comes are the writers' to keep whole (the training loop stops at its next step).
  `default_config` is the --config file when the command line gives none."""
  argv = list(sys.argv if argv is None else argv)
  if default_config and not any(re.fullmatch(r"--?config(=.*)?", arg) for arg in argv[1:]):
    argv.insert(1, f"--config={default_config}")
  # The app may have set its own handler for the seconds its imports take.
  signal.signal(signal.SIGINT, signal.default_int_handler)
  sys.unraisablehook = _interrupt_again
  try:
    app.run(_quietly(_with_compilation_cache(main)), argv=argv, flags_parser=parse_flags)
  except KeyboardInterrupt:
    sys.stderr.write(f"{os.path.basename(argv[0])}: interrupted\n")
    sys.exit(INTERRUPTED)


def log_to_file(path: str) -> None:
  """Sends the process's error reports from here on to the file `path` instead of the
  console: log records at ERROR and above, and the exceptions no caller could catch (in
  a background thread, or ignored as unraisable). Orbax reports a failed save so, in
  hundreds of lines of tracebacks from its threads, which the app's own one-line error
  sums up. Until the directory of `path` exists they stay on the console; with
  --verbosity they go to both."""
  errors = _ErrorFile(path)
  python_logging.getLogger().addHandler(errors)
  if not FLAGS["verbosity"].present:
    logging.get_absl_handler().addFilter(
        lambda record: record.levelno < python_logging.ERROR or not errors.ready())
  sys.unraisablehook = _log_unraisable
  threading.excepthook = _log_thread_exception


class _ErrorFile(python_logging.FileHandler):
  """Appends log records at ERROR and above, in absl's format, to a file it creates at
  the first one, once its directory exists."""

  def __init__(self, path: str):
    super().__init__(os.path.abspath(path), delay=True)
    self.setLevel(python_logging.ERROR)
    self.setFormatter(logging.PythonFormatter())

  def ready(self) -> bool:
    return os.path.isdir(os.path.dirname(self.baseFilename))

  def emit(self, record: python_logging.LogRecord) -> None:
    if self.ready():
      super().emit(record)

  def handleError(self, record: python_logging.LogRecord) -> None:
    """A record the file cannot take (the disk is full) is lost, not printed with a
    traceback of its own on the console."""


def _interrupt_again(unraisable) -> None:
  """sys.unraisablehook: a Ctrl-C whose KeyboardInterrupt was raised where Python ignores
  exceptions (in a garbage collector callback, as JAX's, or a __del__) is delivered
  again, so that it still stops the app; other exceptions are printed as by default."""
  if issubclass(unraisable.exc_type, KeyboardInterrupt):
    # From another thread a moment later, once the main thread has left the callback
    # that swallowed it: delivered from here, it was raised in this hook and swallowed
    # again. Should it land in such a callback again, this hook runs again.
    threading.Timer(0.01, _thread.interrupt_main).start()
  else:
    sys.__unraisablehook__(unraisable)


def _log_unraisable(unraisable) -> None:
  """sys.unraisablehook that logs the exception as an error, with its traceback (a
  KeyboardInterrupt is delivered again, as by `_interrupt_again`)."""
  if issubclass(unraisable.exc_type, KeyboardInterrupt):
    _interrupt_again(unraisable)
    return
  logging.error("%s: %r", unraisable.err_msg or "Exception ignored in", unraisable.object,
                exc_info=(unraisable.exc_type, unraisable.exc_value,
                          unraisable.exc_traceback))


def _log_thread_exception(args) -> None:
  """threading.excepthook that logs the exception as an error, with its traceback."""
  if args.exc_type is SystemExit:   # ends a thread quietly, as by default
    return
  logging.error("exception in thread %s", args.thread.name if args.thread else "?",
                exc_info=(args.exc_type, args.exc_value, args.exc_traceback))


class ModelFlags(NamedTuple):
  """--workdir, --hf_dir and --tokenizer: where an app's model comes from; --quant: how
  it runs."""
  workdir: flags.FlagHolder
  hf_dir: flags.FlagHolder
  tokenizer: flags.FlagHolder
  quant: flags.FlagHolder

  def load(self) -> init_from.Loaded:
    """(config, params, tokenizer) of the workdir or transformers directory given,
    quantized as --quant says (stored-weight modes quantize the float weights once)."""
    try:
      loaded = init_from.load_model(workdir=self.workdir.value, hf_dir=self.hf_dir.value,
                                      tokenizer=self.tokenizer.value)
    except config_lib.ConfigError as error:
      if error.field != "data.tokenizer" or (self.workdir.value and not self.tokenizer.value):
        raise   # a workdir's own tokenizer is its config's data.tokenizer
      flag = "--tokenizer" if self.tokenizer.value else "--hf_dir (pass --tokenizer)"
      raise ValueError(f"{flag}: {str(error)[len('config.data.tokenizer: '):]}") from None
    mode = self.quant.value
    if mode in (None, loaded.config.model.quant):
      return loaded
    if loaded.config.model.quant in quant.STORED_MODES:
      raise config_lib.ConfigError(
          "model.quant", f"{self.workdir.value or self.hf_dir.value} holds "
          f"{loaded.config.model.quant} integer weights (a QLoRA run's base), which "
          f"--quant={mode} cannot turn back into floats: leave --quant out")
    if mode in quant.STORED_MODES:
      config, params = quant.quantize(loaded.config, loaded.params, mode)
    else:
      config, params = quant.float_config(loaded.config), loaded.params
      config.model.quant = mode
      config_lib.validate(config)
    return loaded._replace(config=config, params=params)


def define_model_flags() -> ModelFlags:
  """Defines the flags of `ModelFlags`: a training workdir (its latest checkpoint, LoRA
  merged, and the config and tokenizer it was trained with) or a transformers directory."""
  return ModelFlags(
      flags.DEFINE_string("workdir", None, "Training workdir: its latest checkpoint, with "
                          "the config and tokenizer it was trained with."),
      flags.DEFINE_string("hf_dir", None, "A transformers save_pretrained directory."),
      flags.DEFINE_string("tokenizer", None, "'byte', a tokenizer file or directory; "
                          "default: the run's with --workdir, the directory's own files "
                          "with --hf_dir."),
      flags.DEFINE_enum("quant", None, list(config_lib.QUANT_MODES), "Run the model "
                        "quantized (gemma_jax.quant): int8_weights / int4_weights store its "
                        "projections' weights as integers (int4 in groups of the config's "
                        "model.quant_group_size); int8 / fp8 round weights and activations. "
                        "Default: as trained."))


def define_cache_dtype_flag() -> flags.FlagHolder:
  """--cache_dtype: the dtype an app's KV cache keeps keys and values in."""
  return flags.DEFINE_enum("cache_dtype", None, kv_cache.CACHE_DTYPES,
                           "Dtype of the cached keys and values (int8: with per-token, "
                           "per-head scales); default: bfloat16 on accelerators, else the "
                           "compute dtype.")


def _with_compilation_cache(main):
  """main, after `compilation_cache.enable(--compilation_cache_dir)`."""

  @functools.wraps(main)
  def cached_main(argv):
    compilation_cache.enable(_COMPILATION_CACHE.value)
    return main(argv)

  return cached_main


def _quietly(main):
  """main, called with absl's verbosity at WARNING unless --verbosity was given (absl
  raises it to INFO once flags are parsed; JAX and orbax log through it)."""

  @functools.wraps(main)
  def quiet_main(argv):
    if not FLAGS["verbosity"].present:
      logging.set_verbosity(logging.WARNING)
    return main(argv)

  return quiet_main


HELP_FLAGS = ("-?", "-h", "-help", "--help", "-helpshort", "--helpshort", "-helpfull",
              "--helpfull")


def parse_flags(argv: List[str]) -> List[str]:
  """FLAGS(argv), as absl's own parser; a bad --config file or override exits with one
  error line and status 2; --help lists the config's fields too, and exits 0."""
  try:
    remaining = FLAGS(argv)
    for name in _config_flags():
      # ml_collections defers a config file's load error until the config is used;
      # any attribute, as `lock` here, raises it.
      hasattr(FLAGS[name].value, "lock")
    return remaining
  except SystemExit:   # absl printed a help flag's text; it exits 1
    if not any(arg in HELP_FLAGS for arg in argv[1:]):
      raise
    print_config_fields(FLAGS.read_flags_from_files(argv[1:], force_gnu=False))
    sys.exit(0)
  except Exception as error:   # pylint: disable=broad-except
    problem = _config_problem(FLAGS.read_flags_from_files(argv[1:], force_gnu=False), error)
    if problem:
      sys.stderr.write(f"{os.path.basename(argv[0])}: error: {problem}\n")
      sys.exit(USAGE_ERROR)
    if not isinstance(error, flags.Error):
      raise
    # Any other flag error: absl's message and status (absl cannot parse argv again).
    sys.stderr.write(f"FATAL Flags parsing error: {error}\n"
                     "Pass --helpshort or --helpfull to see help on flags.\n")
    sys.exit(1)


def print_config_fields(args: List[str]) -> None:
  """Each config flag's fields, with the config file's values and what they mean."""
  notes = config_lib.field_notes()
  for name in _config_flags():
    path = _last_value(args, name)
    try:
      config = _load(path) if path else config_lib.default_config()
    except Exception as error:   # pylint: disable=broad-except
      print(f"\n--{name}={path}: cannot be loaded ({_one_line(str(error))})")
      continue
    print(f"\nconfig fields (--{name}.SECTION.FIELD=VALUE), as "
          f"{path or 'the schema'} sets them:")
    for field, value in _fields(config):
      note = notes.get(field, "")
      print(f"  {field} = {value!r}" + (f"  # {note}" if note else ""))


def _fields(config: config_dict.ConfigDict, prefix: str = ""):
  """(dotted field, value) of every leaf of a config, in its order."""
  for key, value in config.items():
    if isinstance(value, config_dict.ConfigDict):
      yield from _fields(value, f"{prefix}{key}.")
    else:
      yield prefix + key, value


def _config_flags() -> List[str]:
  """Names of the flags defined with config_flags.DEFINE_config_file."""
  return [name for name in FLAGS
          if isinstance(FLAGS[name].parser, config_flags.ConfigFileFlagParser)]


def _config_problem(args: List[str], error: Exception) -> Optional[str]:
  """What is wrong with a config flag's file or overrides in args, in one line; None if
  nothing is."""
  for name in _config_flags():
    path = _last_value(args, name)
    if path is None:
      continue
    try:
      config = _load(path)
    except FileNotFoundError:
      return f"--{name}={path}: no such file"
    except Exception as load_error:   # pylint: disable=broad-except
      return f"--{name}={path}: {_one_line(f'{type(load_error).__name__}: {load_error}')}"
    if not isinstance(config, config_dict.ConfigDict):
      continue
    for field in _overrides(args, name):
      problem = _field_problem(config, name, field)
      if problem:
        return f"--{name}.{field}: {problem}"
    # absl words a value its flag's parser refused "flag --NAME=VALUE: why".
    bad_value = re.match(rf"flag --{re.escape(name)}\.([^=\s\[]+)=(.*?): ", str(error))
    if isinstance(error, flags.IllegalFlagValueError) and bad_value:
      field, value = bad_value.groups()
      *parents, leaf = field.split(".")
      section = functools.reduce(lambda node, key: node[key], parents, config)
      return f"--{name}.{field}: expects {_a(section.get_type(leaf))}, got {value!r}"
  return None


def _field_problem(config: config_dict.ConfigDict, name: str, field: str) -> Optional[str]:
  """Why `field` (dotted) names no field of config, or None when it does."""
  node, where = config, name
  for key in field.split("."):
    if "[" in key:   # an index into a sequence: ml_collections' own parser judges it
      return None
    if not isinstance(node, config_dict.ConfigDict):
      return f"{where} is {_a(type(node))}, not a section with fields"
    if key not in node:
      close = difflib.get_close_matches(key, list(node.keys()), n=1)
      hint = (f"did you mean {close[0]!r}?" if close
              else f"its fields are {', '.join(sorted(node.keys()))}")
      return f"{where} has no field {key!r}; {hint}"
    node, where = node[key], f"{where}.{key}"
  return None


def _last_value(args: List[str], name: str) -> Optional[str]:
  """The value of the last --name=VALUE or --name VALUE in args, else the flag's default."""
  value = FLAGS[name].default if isinstance(FLAGS[name].default, str) else None
  for i, arg in enumerate(args):
    if arg == "--":
      break
    match = re.fullmatch(rf"--?{re.escape(name)}(?:=(.*))?", arg, re.DOTALL)
    if match:
      value = match.group(1) if match.group(1) is not None else (
          args[i + 1] if i + 1 < len(args) else None)
  return value


def _overrides(args: List[str], name: str) -> List[str]:
  """The dotted fields that --name.FIELD[=value] (or --noname.FIELD) flags in args set."""
  args = args[:args.index("--")] if "--" in args else args
  override = re.compile(rf"--?(?:no)?{re.escape(name)}\.([^=]+)(?:=.*)?", re.DOTALL)
  return [match.group(1) for arg in args if (match := override.fullmatch(arg))]


def _load(path: str):
  """get_config() of config file `path` ("file.py" or "file.py:argument")."""
  filename, *argument = path.split(":", 1)
  loader = importlib.machinery.SourceFileLoader("gemma_jax_apps_config", filename)
  module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
  loader.exec_module(module)
  return module.get_config(*argument)


def _a(kind: type) -> str:
  """'an int', 'a float': the type's name with its indefinite article."""
  return f"{'an' if kind.__name__[0] in 'aeiouAEIOU' else 'a'} {kind.__name__}"


def _one_line(text: str) -> str:
  """text with its whitespace runs (newlines among them) made single spaces."""
  return " ".join(text.split())
