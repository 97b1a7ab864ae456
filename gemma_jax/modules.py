"""The decoder module a config asks for: the plain `Decoder`, with LoRA adapters
(`lora.LoraDecoder`), with quantized projections (`quant.QuantDecoder`), or both (QLoRA:
adapters over a quantized base)."""

from ml_collections import config_dict

from gemma_jax import lora
from gemma_jax.decoder import Decoder
from gemma_jax.quant.decoder import QuantDecoder


class QuantLoraDecoder(lora.LoraDecoder, QuantDecoder):
  """LoRA adapters on the projections of a quantized model."""


def decoder(config: config_dict.ConfigDict, deterministic: bool = True) -> Decoder:
  """The module for `config` (its model section, lora and quantization)."""
  model = config_dict.FrozenConfigDict(config.model)
  quantized = model.quant != "none"
  if not config.lora.rank:
    return (QuantDecoder if quantized else Decoder)(model, deterministic=deterministic)
  cls = QuantLoraDecoder if quantized else lora.LoraDecoder
  return cls(model, deterministic=deterministic,
             lora=config_dict.FrozenConfigDict(config.lora))
