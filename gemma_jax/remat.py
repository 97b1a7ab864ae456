"""Named rematerialisation (gradient checkpointing) policies.

A layer tags the tensors worth keeping with `jax.ad_checkpoint.checkpoint_name`
(query_proj, key_proj, value_proj, out_proj, mlpwi_0, mlpwi_1, mlpwo); a policy says
which of them the backward pass may keep instead of recomputing.

  none                  no remat: every activation is kept
  full                  keep nothing inside a block; recompute it all
  minimal               keep every projection output (attention and MLP)
  save_qkv_proj         keep the query, key and value projections
  save_dot_except_mlp   keep the attention projections, recompute the MLP
  save_out_proj         keep the attention output projection
  qkv_proj_offloaded    like save_qkv_proj, parked in pinned host memory
  minimal_offloaded     like minimal, parked in pinned host memory
"""

import jax

QKV = ("query_proj", "key_proj", "value_proj")
MLP = ("mlpwi_0", "mlpwi_1", "mlpwo")
_save = jax.checkpoint_policies.save_only_these_names


def _offload(names):
  return jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=[], names_which_can_be_offloaded=list(names),
      offload_src="device", offload_dst="pinned_host")


POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "minimal": _save(*QKV, "out_proj", *MLP),
    "save_qkv_proj": _save(*QKV),
    "save_dot_except_mlp": _save(*QKV, "out_proj"),
    "save_out_proj": _save("out_proj"),
    "qkv_proj_offloaded": _offload(QKV),
    "minimal_offloaded": _offload(QKV + ("out_proj",) + MLP),
}


def is_remat(name: str) -> bool:
  """Whether the named policy wraps blocks in nn.remat at all."""
  return POLICIES[name] is not None
