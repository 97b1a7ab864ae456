r"""Serves a model over HTTP with OpenAI's API: a training workdir's latest checkpoint (a
LoRA run's adapters merged) or a transformers save_pretrained directory.

    python experiments/serve.py --hf_dir=path/to/gemma-3-1b-it --num_slots=16
    curl localhost:8000/v1/chat/completions -H 'content-type: application/json' \
        -d '{"messages": [{"role": "user", "content": "What is 12 plus 30?"}]}'

Or the official client: `openai.OpenAI(base_url="http://127.0.0.1:8000/v1",
api_key="none")`. Endpoints: /v1/completions, /v1/chat/completions (streamed too),
/v1/models, /health, /metrics (Prometheus); see gemma_jax.serving.server. Requests are
decoded together on a paged KV cache (gemma_jax.serving.engine): --num_slots at once,
the rest queued up to --max_queue, past which a request is refused with 429.

SIGTERM or Ctrl-C: new requests are refused (429) while the running ones finish, for
--grace_seconds at most (the rest are cancelled); then the server stops. A second Ctrl-C
stops it at once.
"""

import os
import sys
import threading

from absl import flags
import uvicorn

import gemma_jax as gj
from gemma_jax import apps
from gemma_jax import config as config_lib
from gemma_jax import sharding
from gemma_jax.serving import engine as engine_lib
from gemma_jax.serving import openai_api
from gemma_jax.serving import server

_MODEL = apps.define_model_flags()
_MODEL_NAME = flags.DEFINE_string("model_name", None, "The model's id in the API (a "
                                  "request's \"model\"); default: the base name of "
                                  "--hf_dir or --workdir.")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0: every "
                            "interface).")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on.")
_NUM_SLOTS = flags.DEFINE_integer("num_slots", 8, "Requests decoded at once.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Positions per KV cache page.")
_NUM_PAGES = flags.DEFINE_integer("num_pages", None, "KV cache pages shared by the slots; "
                                  "default: enough for every slot's full --max_length.")
_PREFILL_CHUNK = flags.DEFINE_integer("prefill_chunk", 64, "Prompt tokens a request has "
                                      "computed per engine step, between decode steps.")
_PREFILL_ROWS = flags.DEFINE_integer("prefill_rows", 1, "Requests whose prompt chunks one "
                                     "engine step computes together.")
_LOCAL_CACHE_PAGES = flags.DEFINE_integer("local_cache_pages", 0, "Pages the sliding-window "
                                          "layers' pool adds to keep cached prefixes' windows "
                                          "(a prefix is reused only while they are kept).")
_MAX_LENGTH = flags.DEFINE_integer("max_length", 1024, "Positions per request (prompt and "
                                   "output), within the model's position table if it has one.")
_MAX_QUEUE = flags.DEFINE_integer("max_queue", 256, "Requests waiting for a slot at most; "
                                  "past it a request gets 429.")
_CACHE_DTYPE = apps.define_cache_dtype_flag()
_MESH = flags.DEFINE_list("mesh", None, "Run sharded over the devices: mesh axis sizes as "
                          "axis=size (data, fsdp, tensor, expert; -1: the devices left over), "
                          "e.g. tensor=4,data=2 (weights and the KV pages' heads over "
                          "tensor). Default: one device.")
_GRACE_SECONDS = flags.DEFINE_float("grace_seconds", 30.0, "On SIGTERM or Ctrl-C, seconds "
                                    "the running requests have to finish.")


class _Server(uvicorn.Server):
  """uvicorn's server, stopped by SIGTERM or Ctrl-C only once the engine has shut down:
  new requests refused, the running ones finished within the grace period, so that
  their responses are written. A signal during that wait is uvicorn's own (a second
  Ctrl-C stops at once)."""

  def __init__(self, config: uvicorn.Config, engine, grace_seconds: float, model_name: str):
    super().__init__(config)
    self.engine, self.grace_seconds, self.model_name = engine, grace_seconds, model_name
    self.draining = False

  async def startup(self, sockets=None) -> None:
    await super().startup(sockets)
    if self.started:   # listening
      print(f"serving {self.model_name} at http://{self.config.host}:{self.config.port}/v1",
            flush=True)

  def handle_exit(self, sig, frame) -> None:
    if self.draining:
      super().handle_exit(sig, frame)
      return
    self.draining = True
    # Not in the handler: it runs on the event loop's thread, which must keep writing.
    threading.Thread(target=self._drain, args=(sig,), daemon=True).start()

  def _drain(self, sig) -> None:
    self.engine.shutdown(self.grace_seconds)
    super().handle_exit(sig, None)   # uvicorn stops, then raises `sig` again


def _mesh(config):
  """The device mesh --mesh asks for (config.mesh updated), or None for one device."""
  if _MESH.value is None:
    return None
  for item in _MESH.value:
    axis, _, size = item.partition("=")
    if axis not in config_lib.MESH_AXES or not size.lstrip("-").isdigit():
      raise ValueError(f"--mesh: {item!r} is not axis=size with an axis of "
                       f"{', '.join(config_lib.MESH_AXES)}")
    config.mesh[axis] = int(size)
  return sharding.make_mesh(config.mesh)


def main(argv):
  del argv
  try:
    config, params, tokenizer = _MODEL.load()
    engine = engine_lib.Engine(
        config, params, tokenizer=tokenizer, num_slots=_NUM_SLOTS.value,
        page_size=_PAGE_SIZE.value, num_pages=_NUM_PAGES.value,
        prefill_chunk=_PREFILL_CHUNK.value, prefill_rows=_PREFILL_ROWS.value,
        local_cache_pages=_LOCAL_CACHE_PAGES.value, max_length=_MAX_LENGTH.value,
        max_queue=_MAX_QUEUE.value, cache_dtype=_CACHE_DTYPE.value, mesh=_mesh(config))
  except (gj.ConfigError, ValueError, OSError) as error:   # WorkdirError, CheckpointError too
    sys.exit(f"serve.py: error: {error}")
  path = _MODEL.hf_dir.value or _MODEL.workdir.value
  name = _MODEL_NAME.value or os.path.basename(os.path.normpath(path))
  app = server.make_app(engine, tokenizer, model_name=name, images_to_request=(
      openai_api.attach_images if config.model.vision.enabled else None))
  http = _Server(uvicorn.Config(app, host=_HOST.value, port=_PORT.value, log_level="warning",
                                timeout_graceful_shutdown=int(_GRACE_SECONDS.value) + 1),
                 engine, _GRACE_SECONDS.value, name)
  engine.start()
  try:
    http.run()
  finally:
    if not http.draining:   # uvicorn stopped on its own (the port was taken)
      engine.shutdown(0.0)


if __name__ == "__main__":
  apps.run(main)
