"""rtcinfer's ops as PyTorch custom ops (torch.library), so that torch.compile traces a model
that calls them as single opaque nodes, without graph breaks (fullgraph=True), with their
mutations declared and fake (meta) implementations for shapes. Imported only where PyTorch
is: the public functions route a call here while PyTorch is compiling
(interop.arrays.torch_compiling) and run their usual launch path otherwise, eager calls
paying one module-name test for it.

Registered here: the norms, the gated activations, every RoPE form, the attention-state merges,
the paged-cache append and index ops (functional, in-place and `out=` forms), and the samplers,
renorms, softmax and the norms with an fp8 output (ops whose scalar-or-array parameters are
split in two arguments), top_k, and RoPE with fp8 outputs (rtcinfer/torch_rope_quantize.py).
The attention wrappers' run() is one op of its own (rtcinfer/torch_attention.py).
"""

from __future__ import annotations

import inspect

import torch

from . import activation, norm, rope, torch_rope_quantize
from .attention import cascade, page
from .sampling import renorm, samplers, speculative, topk
from .sampling.softmax import softmax as sampling_softmax

_NAMESPACE = "rtcinfer"


# --- ops registered from their public signatures ----------------------------------------------

# Argument types by name: tensors (optional ones "Tensor?"), ints, bools, strings; any other
# argument is a float.
_TYPES = {
    **dict.fromkeys(("input", "residual", "weight", "gemma", "beta", "q", "k", "query", "key",
                     "indptr", "offsets", "pos_ids", "positions",
                     "cos_sin_cache", "v_a", "s_a", "v_b", "s_b", "v", "s", "v_other",
                     "s_other", "sinks", "append_key", "append_value", "batch_indices",
                     "paged_kv_cache", "k_cache", "v_cache", "kv_indices", "kv_indptr",
                     "kv_last_page_len", "append_indptr", "seq_lens"), "Tensor"),
    "mask": "Tensor?", "rotary_dim": "SymInt?", "head_size": "SymInt", "page_size": "SymInt",
    "nnz": "SymInt", "interleave": "bool", "is_neox": "bool", "kv_layout": "str",
}  # fmt: skip


_WRITTEN: dict[str, tuple[str, ...]] = {}  # op name -> the arguments it writes in place
# Arguments a public function takes for FlashInfer compatibility that change nothing it does
# (dependent launches are process-wide): left out of the ops' schemas.
_HINTS = ("enable_pdl",)


def _register(public, name: str, mutated=(), outputs=(), fake=None) -> None:
    """A custom op `name` calling `public` with the arguments of its signature (by name and in
    order, `out` left out). `mutated`: the arguments it writes in place (it then returns
    nothing; call_public returns them as the public function does). `outputs`: the arguments
    it returns new arrays like (fake: empty_like of them) unless `fake` says otherwise; with
    outputs, an `{name}_out` op takes their `_out` arrays last and writes them."""
    names = [n for n in inspect.signature(public).parameters if n != "out" and n not in _HINTS]
    _WRITTEN[name] = tuple(mutated)
    marks = iter("abcdef")

    def arg(n: str) -> str:
        kind = _TYPES.get(n, "float")
        return f"Tensor({next(marks)}!) {n}" if n in mutated else f"{kind} {n}"

    args = ", ".join(arg(n) for n in names)
    at = [names.index(n) for n in outputs]
    single = len(at) == 1
    returns = "()" if not at else "Tensor" if single else f"({', '.join('Tensor' for _ in at)})"

    def run(*a):
        result = public(*a)
        return None if not at else result if single else tuple(result)

    def like(*a):
        made = tuple(torch.empty_like(a[i]) for i in at)
        return None if not at else made[0] if single else made

    op = torch.library.custom_op(f"{_NAMESPACE}::{name}", run, mutates_args=tuple(mutated),
                                 schema=f"({args}) -> {returns}")  # fmt: skip
    op.register_fake(fake or like)
    if not at or "out" not in inspect.signature(public).parameters:
        return

    def run_out(*a) -> None:
        outs = a[-len(at) :]
        public(*a[: -len(at)], out=outs[0] if single else outs)

    outs = ", ".join(f"Tensor({m}!) {names[i]}_out" for m, i in zip("uvwxyz", at, strict=False))
    op_out = torch.library.custom_op(f"{_NAMESPACE}::{name}_out", run_out,
                                     mutates_args=tuple(f"{names[i]}_out" for i in at),
                                     schema=f"({args}, {outs}) -> ()")  # fmt: skip
    op_out.register_fake(lambda *a: None)


for _public in (norm.rmsnorm, norm.gemma_rmsnorm, norm.layernorm):
    _register(_public, _public.__name__, outputs=("input",))
for _public in (norm.fused_add_rmsnorm, norm.gemma_fused_add_rmsnorm):
    _register(_public, _public.__name__, mutated=("input", "residual"))
for _public in (activation.silu_and_mul, activation.gelu_and_mul, activation.gelu_tanh_and_mul):
    _register(
        _public,
        _public.__name__,
        outputs=("input",),  # [..., 2d] -> [..., d]
        fake=lambda input: input.new_empty((*input.shape[:-1], input.shape[-1] // 2)),
    )

_ROTATED = ("q", "k", "query", "key")
for _public in rope.PUBLIC:  # every RoPE form: in place (q, k written) or into new arrays
    _rotated = [n for n in inspect.signature(_public).parameters if n in _ROTATED]
    if _public.__name__.endswith("_inplace"):
        _register(_public, _public.__name__, mutated=_rotated)
    else:
        _register(_public, _public.__name__, outputs=_rotated)

_register(cascade.merge_state, "merge_state", outputs=("v_a", "s_a"))
_register(cascade.merge_state_in_place, "merge_state_in_place", mutated=("v", "s"))
_register(cascade.merge_sinks_in_place, "merge_sinks_in_place", mutated=("v", "s"))
_register(cascade.merge_states, "merge_states", outputs=("v", "s"),
          fake=lambda v, s: (v.new_empty((v.shape[0], *v.shape[2:])),
                             s.new_empty((s.shape[0], *s.shape[2:]))))  # fmt: skip


def _register_quant(public, tensors: tuple[str, ...], mutated: tuple[str, ...] = ()) -> None:
    """A norm with an fp8 output (rmsnorm_quant, fused_add_rmsnorm_quant, layernorm_quant) as
    the custom op of its name: its arguments in order (`tensors`: those between input and
    scale, `mutated` among them written as out is), the scale split into an array and a
    number as the samplers' parameters (call_public routes it: _ROUTES)."""
    name = public.__name__
    marks = iter("bcd")
    args = "".join(f"Tensor({next(marks)}!) {t}, " if t in mutated else f"Tensor {t}, "
                   for t in tensors)  # fmt: skip
    schema = (f"(Tensor(a!) out, Tensor input, {args}Tensor? scale_arr, float scale, float eps, "
              "str? out_dtype) -> ()")  # fmt: skip

    def run(out, input, *rest) -> None:
        *front, scale_arr, scale, eps, out_dtype = rest
        public(out, input, *front, _pick(scale_arr, scale), eps, out_dtype=out_dtype)

    op = torch.library.custom_op(f"{_NAMESPACE}::{name}", run, mutates_args=("out", *mutated),
                                 schema=schema)  # fmt: skip
    op.register_fake(lambda *a: None)

    def route(out, input, scale, eps, out_dtype=None, **given):
        front = tuple(given[t] for t in tensors)
        scale_arr, value = _split(scale)
        op = getattr(getattr(torch.ops, _NAMESPACE), name)
        op(out, input, *front, scale_arr, 1.0 if value is None else float(value), float(eps),
           out_dtype)  # fmt: skip
        return (out, given["residual"]) if "residual" in mutated else out

    _ROUTES[name] = route


_ROUTES: dict = {}  # public name -> its call under torch.compile, the bound arguments by name


def _top_k(input, k, sorted, deterministic, tie_break, dsa_graph_safe):
    return tuple(topk.top_k(input, k, sorted, deterministic, tie_break, dsa_graph_safe))


_TOP_K = torch.library.custom_op(
    f"{_NAMESPACE}::top_k", _top_k, mutates_args=(),
    schema="(Tensor input, SymInt k, bool sorted, bool deterministic, SymInt tie_break, "
           "bool dsa_graph_safe) -> (Tensor, Tensor)",
)  # fmt: skip
_TOP_K.register_fake(lambda input, k, *flags: (input.new_empty((input.shape[0], k)),
                                               input.new_empty((input.shape[0], k),
                                                               dtype=torch.int64)))  # fmt: skip
_ROUTES.update(torch_rope_quantize.ROUTES)
_register_quant(norm.rmsnorm_quant, ("weight",))
_register_quant(norm.fused_add_rmsnorm_quant, ("residual", "weight"), mutated=("residual",))
_register_quant(norm.layernorm_quant, ("gemma", "beta"))


def _append_pair(append_key, append_value, batch_indices, positions, k_cache, v_cache,
                 kv_indices, kv_indptr, kv_last_page_len, kv_layout="NHD"):  # fmt: skip
    """append_paged_kv_cache into a (k_cache, v_cache) pair (a schema takes no tuple)."""
    return page.append_paged_kv_cache(append_key, append_value, batch_indices, positions,
                                      (k_cache, v_cache), kv_indices, kv_indptr,
                                      kv_last_page_len, kv_layout)  # fmt: skip


_register(page.append_paged_kv_cache, "append_paged_kv_cache", mutated=("paged_kv_cache",))
_register(_append_pair, "append_paged_kv_cache_pair", mutated=("k_cache", "v_cache"))


_register(
    page.get_seq_lens,
    "get_seq_lens",
    outputs=("kv_last_page_len",),
    fake=lambda kv_indptr, last, page_size: last.new_empty(last.shape, dtype=kv_indptr.dtype),
)


def _positions(append_indptr, seq_lens, nnz):
    """get_batch_indices_positions without the caller's buffers (its functional form)."""
    return page.get_batch_indices_positions(append_indptr, seq_lens, nnz)


def _positions_into(append_indptr, seq_lens, nnz, batch_indices, positions):
    """get_batch_indices_positions into the caller's buffers."""
    return page.get_batch_indices_positions(append_indptr, seq_lens, nnz, batch_indices,
                                            positions)  # fmt: skip


def _int32s(append_indptr, seq_lens, nnz):
    return tuple(seq_lens.new_empty((nnz,), dtype=torch.int32) for _ in range(2))


# two int32 [nnz] outputs (the names only count them: their fake is _int32s)
_register(_positions, "get_batch_indices_positions", outputs=("append_indptr", "seq_lens"),
          fake=_int32s)  # fmt: skip
_register(_positions_into, "get_batch_indices_positions_into",
          mutated=("batch_indices", "positions"))  # fmt: skip


# --- sampling: scalar-or-array parameters split into an array and a scalar argument -------------

_SAMPLE_ARGS = ("str op, Tensor probs, Tensor? indices, Tensor? top_k_arr, SymInt top_k, "
                "Tensor? top_p_arr, float top_p, Tensor? min_p_arr, float min_p, "
                "bool check_nan, Tensor? seed_arr, SymInt? seed, "
                "Tensor? offset_arr, SymInt? offset")  # fmt: skip


def _pick(array, value):
    return array if array is not None else value


def _sample_run(op, probs, indices, top_k_arr, top_k, top_p_arr, top_p, min_p_arr, min_p,
                check_nan, seed_arr, seed, offset_arr, offset, out=None):  # fmt: skip
    return samplers._sample(op, probs, indices, top_k=_pick(top_k_arr, top_k),
                            top_p=_pick(top_p_arr, top_p), min_p=_pick(min_p_arr, min_p),
                            seed=_pick(seed_arr, seed),
                            offset=_pick(offset_arr, offset), check_nan=check_nan,
                            out=out)  # fmt: skip


def _sample_fake(op, probs, indices, *rest):
    rows = probs.shape[0] if indices is None else indices.shape[0]
    dtype = torch.int32 if indices is None else indices.dtype
    return probs.new_empty((rows,), dtype=dtype)


_sample_op = torch.library.custom_op(f"{_NAMESPACE}::sample", _sample_run, mutates_args=(),
                                     schema=f"({_SAMPLE_ARGS}) -> Tensor")  # fmt: skip
_sample_op.register_fake(_sample_fake)


def _sample_out_run(*a) -> None:
    _sample_run(*a[:-1], out=a[-1])


_sample_out_op = torch.library.custom_op(
    f"{_NAMESPACE}::sample_out", _sample_out_run, mutates_args=("out",),
    schema=f"({_SAMPLE_ARGS}, Tensor(a!) out) -> ()",
)  # fmt: skip
_sample_out_op.register_fake(lambda *a: None)


def _split(value):
    """(array, None) for a tensor parameter, (None, value) for a number."""
    return (value, None) if isinstance(value, torch.Tensor) else (None, value)


def _refuse_generator(generator) -> None:
    """A torch.Generator cannot be carried into a compiled graph: seeds can."""
    if generator is not None:
        raise TypeError(
            "under torch.compile, pass seed= and offset= (tensors where they change between "
            "calls) instead of a torch.Generator: a compiled graph cannot carry one"
        )


def sample(op, probs, indices, top_k, top_p, min_p, generator, check_nan, seed, offset, out):
    """samplers._sample as the custom op (its parameters split for the schema). A
    torch.Generator cannot be carried into a compiled graph: seeds can (seed= and offset=, as
    tensors where they change between calls)."""
    _refuse_generator(generator)
    (k_arr, k), (p_arr, p), (m_arr, m) = _split(top_k), _split(top_p), _split(min_p)
    (seed_arr, seed), (offset_arr, offset) = _split(seed), _split(offset)
    args = (op, probs, indices, k_arr, 0 if k is None else int(k), p_arr,
            1.0 if p is None else float(p), m_arr, 0.0 if m is None else float(m),
            bool(check_nan), seed_arr, seed, offset_arr, offset)  # fmt: skip
    ops = getattr(torch.ops, _NAMESPACE)
    if out is None:
        return ops.sample(*args)
    ops.sample_out(*args, out)
    return out


_SPECULATIVE_ARGS = ("Tensor draft_probs, Tensor draft_token_ids, Tensor target_probs, "
                     "bool deterministic, Tensor? seed_arr, SymInt? seed, Tensor? offset_arr, "
                     "SymInt? offset")  # fmt: skip


def _speculative_run(draft_probs, draft_token_ids, target_probs, deterministic, seed_arr, seed,
                     offset_arr, offset, accepted=None, emitted=None):  # fmt: skip
    result = speculative.chain_speculative_sampling(
        draft_probs, draft_token_ids, target_probs, accepted, emitted,
        deterministic=deterministic, seed=_pick(seed_arr, seed), offset=_pick(offset_arr, offset),
    )  # fmt: skip
    return tuple(result) if accepted is None else result[0]


def _speculative_fake(draft_probs, draft_token_ids, *rest):
    batch, n = draft_token_ids.shape
    ids = draft_probs.new_empty((batch, n + 1), dtype=torch.int32)
    if len(rest) > 6:  # the counters given: only the token ids are new
        return ids
    return ids, *(draft_probs.new_empty((batch,), dtype=torch.int32) for _ in range(2))


_speculative = torch.library.custom_op(
    f"{_NAMESPACE}::chain_speculative_sampling", _speculative_run, mutates_args=(),
    schema=f"({_SPECULATIVE_ARGS}) -> (Tensor, Tensor, Tensor)",
)  # fmt: skip
_speculative.register_fake(_speculative_fake)
_speculative_into = torch.library.custom_op(
    f"{_NAMESPACE}::chain_speculative_sampling_into", _speculative_run,
    mutates_args=("accepted", "emitted"),
    schema=f"({_SPECULATIVE_ARGS}, Tensor(a!) accepted, Tensor(b!) emitted) -> Tensor",
)  # fmt: skip
_speculative_into.register_fake(_speculative_fake)


def speculative_sampling(draft_probs, draft_token_ids, target_probs, accepted, emitted,
                         deterministic, generator, seed, offset):  # fmt: skip
    """chain_speculative_sampling as a custom op: counters allocated (three new arrays) or
    the caller's, updated in place (the op returns the token ids)."""
    _refuse_generator(generator)
    (seed_arr, seed), (offset_arr, offset) = _split(seed), _split(offset)
    args = (draft_probs, draft_token_ids, target_probs, bool(deterministic), seed_arr, seed,
            offset_arr, offset)  # fmt: skip
    ops = getattr(torch.ops, _NAMESPACE)
    if accepted is None and emitted is None:
        return ops.chain_speculative_sampling(*args)
    given = accepted if accepted is not None else emitted
    accepted = torch.zeros_like(given) if accepted is None else accepted
    emitted = torch.zeros_like(given) if emitted is None else emitted
    return ops.chain_speculative_sampling_into(*args, accepted, emitted), accepted, emitted


def _threshold_run(op: str, x, param_arr, param: float, integral: bool):
    value = param_arr if param_arr is not None else int(param) if integral else param
    return renorm._threshold_op(op, x, value, int if integral else float)


_threshold = torch.library.custom_op(
    f"{_NAMESPACE}::threshold", _threshold_run, mutates_args=(),
    schema="(str op, Tensor x, Tensor? param_arr, float param, bool integral) -> Tensor",
)  # fmt: skip
_threshold.register_fake(lambda op, x, param_arr, param, integral: torch.empty_like(x))


def threshold(op: str, x, param, kind: type):
    """renorm._threshold_op (renorms and the top-k mask) as the custom op."""
    arr, value = _split(param)
    integral = kind is int
    scalar = 0.0 if value is None else float(value)
    return getattr(torch.ops, _NAMESPACE).threshold(op, x, arr, scalar, integral)


def _softmax_run(logits, temperature_arr, temperature: float):
    return sampling_softmax(logits, _pick(temperature_arr, temperature))


_softmax = torch.library.custom_op(
    f"{_NAMESPACE}::softmax", _softmax_run, mutates_args=(),
    schema="(Tensor logits, Tensor? temperature_arr, float temperature) -> Tensor",
)  # fmt: skip
_softmax.register_fake(lambda logits, arr, t: logits.new_empty(logits.shape, dtype=torch.float32))


def softmax(logits, temperature):
    arr, value = _split(1.0 if temperature is None else temperature)
    return getattr(torch.ops, _NAMESPACE).softmax(logits, arr, 1.0 if value is None else value)


def call(name: str, *args, out=None):
    """The custom op `name` (its `_out` form when `out` is given: an array, or a tuple of
    them) on args; returns what the public function returns."""
    ops = getattr(torch.ops, _NAMESPACE)
    if out is None:
        return getattr(ops, name)(*args)
    outs = out if isinstance(out, tuple) else (out,)
    getattr(ops, f"{name}_out")(*args, *outs)
    return out


def call_public(public, args: tuple, kwargs: dict, name: str | None = None):
    """A public function's call as its custom op (`name`, else the function's): the arguments
    bound to its signature (its defaults filled in) and passed in order; what the function
    returns (an in-place op's written arrays, as the function gives them back)."""
    bound = inspect.signature(public).bind(*args, **kwargs)
    bound.apply_defaults()
    values = dict(bound.arguments)
    for hint in _HINTS:
        values.pop(hint, None)
    name = name or public.__name__
    route = _ROUTES.get(name)
    if route is not None:
        return route(**values)
    out = values.pop("out", None)
    result = call(name, *values.values(), out=out)
    if result is not None:
        return result
    arrays = tuple(values[n] for n in _WRITTEN[name])
    return arrays[0] if len(arrays) == 1 else arrays


__all__ = ["call", "call_public", "sample", "softmax", "speculative_sampling", "threshold"]
