"""Attention: one causal self-attention call with three backends, and the grouped decode attention.

`attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, mask_BxL, backend, mesh)` is the only entry point for full-sequence
(training / scoring / prefill) attention. H query heads share G key/value heads (GQA); K/V are never repeated,
the query heads are viewed as [G, R = H/G] instead. `mask_BxL` marks real tokens (False = padding), or holds
SEGMENT IDS for rows that pack several sequences (ints, 0 = padding, each sequence its own id >= 1); a real query
sees the causal keys of its own segment (a 0/1 mask is one segment per row). Backends:
  "xla"    plain einsum + float32 softmax; runs everywhere and is the reference for the others.
  "cudnn"  `jax.nn.dot_product_attention(implementation="cudnn")` on GPU.
  "splash" the Pallas TPU splash-attention kernel (causal mask + segment ids = padding mask).
Packed rows on the "xla" backend with `block` > 0 take model.packed_attention's blocked path instead, which skips the
key blocks of other sequences (the fused kernels ignore `block`: their masks are dense or causal-only).
"auto" picks the platform's fused kernel; "cudnn" / "splash" fall back to "xla" with one logged warning when the
platform is not gpu / tpu (all decided by model.config.resolve_attention). The platform is that of the `mesh`'s
devices (the host's default backend without a mesh): a CPU host compiling for TPU devices gets splash.
The splash kernel is a Mosaic custom call, which XLA cannot partition: on a mesh it runs per shard inside
`jax.shard_map`, rows over the batch axes (data x fsdp) and heads over tensor, as the model shards them.

`decode_attention` is the one-token step used with the KV cache: the queries of sample b = p*m + j attend
jointly (one softmax) to the shared prefix K/V of prompt p and to their own suffix K/V, without copying the
prefix m times.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from g2rl_jax.model import packed_attention
from g2rl_jax.model.config import device_compute_capability, resolve_attention
from g2rl_jax.parallel import DEFAULT_RULES

_NEG = -1e30  # finite "minus infinity": fully masked rows (padding queries) stay NaN-free


def mesh_platform(mesh) -> str | None:
    """The platform of a mesh's devices ("tpu", "gpu", "cpu"); None without a mesh (the host's backend decides)."""
    if mesh is None or mesh.empty:
        return None
    platform = mesh.devices.flat[0].platform
    return "gpu" if platform in ("cuda", "rocm") else platform


def mesh_kernel(requested: str, dtype, mesh=None) -> str:
    """The kernel `requested` resolves to on `mesh`'s devices (their platform and, on GPU, compute capability)."""
    cc = None if mesh is None or mesh.empty else device_compute_capability(mesh.devices.flat[0])
    return resolve_attention(requested, dtype, mesh_platform(mesh), cc)


def attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, mask_BxL, backend: str = "xla", mesh=None, block: int = 0):
    """Causal GQA self-attention with a key padding mask; returns [B, L, H, K] in q's dtype. `mesh`: where the
    arrays live (rows over data x fsdp, heads over tensor); its devices' platform decides "auto". `block` > 0:
    packed rows (segment ids, each sequence one contiguous run), computed block-sparse on the xla backend."""
    backend = mesh_kernel(backend, q_BxLxHxK.dtype, mesh)
    if backend == "cudnn":
        return fused(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, mask_BxL)
    if backend == "splash":
        return splash(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, mask_BxL, mesh=mesh)
    if block:
        kernel = functools.partial(packed_attention.blocked, block=block)
        return per_shard(kernel, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, mask_BxL, mesh)
    return xla(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, mask_BxL)


def xla(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_BxS):
    """Reference attention: scores and softmax in float32; query i sees key j iff i >= j, key j is real and in query
    i's segment (a padding query sees every causal real key: NaN-free)."""
    B, L, H, K = q_BxLxHxK.shape
    G = k_BxSxGxK.shape[2]
    q_BxLxGxRxK = q_BxLxHxK.reshape(B, L, G, H // G, K)
    s_BxGxRxLxS = jnp.einsum("blgrk,bsgk->bgrls", q_BxLxGxRxK, k_BxSxGxK,
                             preferred_element_type=jnp.float32) * K ** -0.5
    S = k_BxSxGxK.shape[1]
    causal_LxS = jnp.arange(L)[:, None] >= jnp.arange(S)[None, :]
    seg_BxS = mask_BxS.astype(jnp.int32)
    same_BxLxS = (seg_BxS[:, :L, None] == seg_BxS[:, None, :]) | (seg_BxS[:, :L, None] == 0)
    allowed_Bx1x1xLxS = (causal_LxS[None] & (seg_BxS[:, None, :] > 0) & same_BxLxS)[:, None, None]
    s_BxGxRxLxS = jnp.where(allowed_Bx1x1xLxS, s_BxGxRxLxS, _NEG)
    p_BxGxRxLxS = jax.nn.softmax(s_BxGxRxLxS, axis=-1).astype(v_BxSxGxK.dtype)
    out_BxLxGxRxK = jnp.einsum("bgrls,bsgk->blgrk", p_BxGxRxLxS, v_BxSxGxK)
    return out_BxLxGxRxK.reshape(B, L, H, K)


def fused(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, mask_BxL, implementation: str = "cudnn"):
    """`jax.nn.dot_product_attention` (cuDNN on GPU, bf16; "xla" lets CPU tests check the masking); native GQA.

    Real queries see causal keys of their segment; padding queries see causal padding keys, so no row is empty (an
    empty row could put NaN into padding K/V, and 0 * NaN would reach real tokens).
    """
    seg_BxL = mask_BxL.astype(jnp.int32)
    allowed_Bx1xLxL = (seg_BxL[:, None, :] == seg_BxL[:, :, None])[:, None]
    return jax.nn.dot_product_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, mask=allowed_Bx1xLxL,
                                        is_causal=True, implementation=implementation)


def splash(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, mask_BxL, *, mesh=None, interpret: bool = False, block: int = 128):
    """TPU splash attention, one MQA kernel per KV head (vmapped over batch and KV heads); on a `mesh`, run per
    shard under `jax.shard_map` (rows over data x fsdp, heads over tensor; a dimension that does not divide its mesh
    axes is not split), since XLA cannot partition a Mosaic kernel.

    The sequence is right-padded to a multiple of `block`; padding tokens get segment id 0 and real ones theirs (1
    for a 0/1 mask), so real queries see only their segment's keys and every query row has at least itself (no
    empty softmax).
    `interpret=True` runs the Pallas kernel in the interpreter (CPU tests).
    """
    kernel = functools.partial(_splash_local, interpret=interpret, block=block)
    return per_shard(kernel, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, mask_BxL, mesh)


def per_shard(kernel, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, mask_BxL, mesh):
    """kernel(q, k, v, mask) on each device's rows and heads under `jax.shard_map` (rows over data x fsdp, heads
    over tensor, as the model shards them); called whole without a mesh of several devices."""
    if mesh is None or mesh.empty or mesh.size == 1:
        return kernel(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, mask_BxL)
    B, _, H, _ = q_BxLxHxK.shape
    rows = _split(mesh, DEFAULT_RULES.mesh_axes("batch"), B)
    heads = _split(mesh, DEFAULT_RULES.mesh_axes("heads"), H, k_BxLxGxK.shape[2])
    qkv = P(rows, None, heads, None)
    return jax.shard_map(kernel, mesh=mesh, in_specs=(qkv, qkv, qkv, P(rows, None)), out_specs=qkv,
                         check_vma=False)(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, mask_BxL)


def _split(mesh, axes: tuple[str, ...], *sizes: int):
    """The mesh axes a dimension of these sizes is split over under shard_map (None: kept whole, when they do not
    divide every size or the axes have size 1)."""
    parts = math.prod(mesh.shape[a] for a in axes)
    if parts == 1 or any(n % parts for n in sizes):
        return None
    return axes[0] if len(axes) == 1 else axes


def _splash_local(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, mask_BxL, *, interpret: bool, block: int):
    """The splash kernel on the arrays of one device (see `splash`)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    B, L, H, K = q_BxLxHxK.shape
    G = k_BxLxGxK.shape[2]
    Lp = -(-L // block) * block
    pad = ((0, 0), (0, Lp - L), (0, 0), (0, 0))
    q_BxGxRxLxK = jnp.pad(q_BxLxHxK * K ** -0.5, pad).reshape(B, Lp, G, H // G, K).transpose(0, 2, 3, 1, 4)
    k_BxGxLxK = jnp.pad(k_BxLxGxK, pad).transpose(0, 2, 1, 3)
    v_BxGxLxK = jnp.pad(v_BxLxGxK, pad).transpose(0, 2, 1, 3)
    seg_BxL = jnp.pad(mask_BxL.astype(jnp.int32), ((0, 0), (0, Lp - L)))
    sizes = sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                          block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    mask = sa.MultiHeadMask([sa.CausalMask((Lp, Lp))] * (H // G))
    kernel = sa.make_splash_mqa_single_device(mask=mask, block_sizes=sizes, interpret=interpret)

    def one(q_RxLxK, k_LxK, v_LxK, seg_L):
        return kernel(q_RxLxK, k_LxK, v_LxK, segment_ids=sa.SegmentIds(q=seg_L, kv=seg_L))

    per_head = jax.vmap(one, in_axes=(0, 0, 0, None))
    out_BxGxRxLxK = jax.vmap(per_head)(q_BxGxRxLxK, k_BxGxLxK, v_BxGxLxK, seg_BxL)
    return out_BxGxRxLxK.transpose(0, 3, 1, 2, 4).reshape(B, Lp, H, K)[:, :L].astype(q_BxLxHxK.dtype)


@functools.partial(jax.named_call, name="decode_attention")
def decode_attention(q_BxHxK, prefix_k_PxGxSxK, prefix_v_PxGxSxK, prefix_mask_PxS,
                     suffix_k_BxGxTxK, suffix_v_BxGxTxK, num_valid_suffix, reads: tuple[int, ...] = ()):
    """One decode step for B = P*m samples: a joint softmax over prompt p's prefix and sample b's own suffix.

    Suffix slots t < num_valid_suffix are attended (the caller has already written the current token's K/V).
    reads (static): the read rungs, ascending, the last at most T: the step reads only the first r slots of the
    suffix, r the smallest rung >= num_valid_suffix (a lax.switch with a branch per rung, so one program serves
    every step; the slots past r are empty and masked anyway). Empty: every slot.
    """
    args = (q_BxHxK, prefix_k_PxGxSxK, prefix_v_PxGxSxK, prefix_mask_PxS, suffix_k_BxGxTxK, suffix_v_BxGxTxK,
            num_valid_suffix)
    if len(reads) <= 1:
        return _attend(*args, read=reads[0] if reads else 0)
    rung = jnp.minimum(jnp.searchsorted(jnp.asarray(reads, jnp.int32), num_valid_suffix), len(reads) - 1)
    return jax.lax.switch(rung, [functools.partial(_attend, read=r) for r in reads], *args)


def _attend(q_BxHxK, prefix_k_PxGxSxK, prefix_v_PxGxSxK, prefix_mask_PxS, suffix_k_BxGxTxK, suffix_v_BxGxTxK,
            num_valid_suffix, *, read: int):
    """decode_attention over the first `read` suffix slots (0: all of them).

    Only the queries and the prefix scores are reshaped to [P, m, ...]; the suffix cache is read in its own
    [B, ...] layout (a reshape of it made XLA copy the freshly updated cache on every step).
    """
    if read and read < suffix_k_BxGxTxK.shape[2]:
        suffix_k_BxGxTxK, suffix_v_BxGxTxK = suffix_k_BxGxTxK[:, :, :read], suffix_v_BxGxTxK[:, :, :read]
    B, H, K = q_BxHxK.shape
    P, G, S, _ = prefix_k_PxGxSxK.shape
    m, T, R = B // P, suffix_k_BxGxTxK.shape[2], H // G
    dt = q_BxHxK.dtype
    q_BxGxRxK = q_BxHxK.reshape(B, G, R, K)
    scale = K ** -0.5
    s_pre_PxmxGxRxS = jnp.einsum("pmgrk,pgsk->pmgrs", q_BxGxRxK.reshape(P, m, G, R, K), prefix_k_PxGxSxK.astype(dt),
                                 preferred_element_type=jnp.float32) * scale
    s_pre_BxGxRxS = s_pre_PxmxGxRxS.reshape(B, G, R, S)
    s_suf_BxGxRxT = jnp.einsum("bgrk,bgtk->bgrt", q_BxGxRxK, suffix_k_BxGxTxK.astype(dt),
                               preferred_element_type=jnp.float32) * scale
    prefix_mask_Bx1x1xS = jnp.repeat(prefix_mask_PxS.astype(bool), m, axis=0)[:, None, None, :]
    s_pre_BxGxRxS = jnp.where(prefix_mask_Bx1x1xS, s_pre_BxGxRxS, _NEG)
    s_suf_BxGxRxT = jnp.where(jnp.arange(T) < num_valid_suffix, s_suf_BxGxRxT, _NEG)
    top = jnp.maximum(s_pre_BxGxRxS.max(-1, keepdims=True), s_suf_BxGxRxT.max(-1, keepdims=True))
    e_pre, e_suf = jnp.exp(s_pre_BxGxRxS - top), jnp.exp(s_suf_BxGxRxT - top)
    denom = e_pre.sum(-1, keepdims=True) + e_suf.sum(-1, keepdims=True)
    p_pre_PxmxGxRxS = (e_pre / denom).astype(dt).reshape(P, m, G, R, S)
    out_BxGxRxK = (jnp.einsum("pmgrs,pgsk->pmgrk", p_pre_PxmxGxRxS, prefix_v_PxGxSxK.astype(dt)).reshape(B, G, R, K)
                   + jnp.einsum("bgrt,bgtk->bgrk", (e_suf / denom).astype(dt), suffix_v_BxGxTxK.astype(dt)))
    return out_BxGxRxK.reshape(B, H, K)
