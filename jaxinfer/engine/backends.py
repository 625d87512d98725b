"""Which implementation may run here: the one owner of that rule, of the tuner's candidate lists, and of what
`quantization="auto"` loads.

- `Impls(dtype, attention_impl, matmul_impl)` is the one value type for what an engine runs: the user's pins
  ("auto" fields are left to the tuner), a tuner candidate, or the choice made.
- `cpu_kernel_obstacle` says why the CPU kernels (kernels_cpu/) cannot serve an engine: the CPU backend, a
  float32 model, an unquantized pool, one device, the kernels built. Attention and matmul both ask it.
- `resolve_impl` (attention) and `resolve_matmul_impl` answer an EngineConfig's "auto" with the fixed rule
  (the rule before tuning) and refuse an explicit impl that cannot run, naming why, before anything compiles.
- `candidates` lists what the tuner may time on a backend, keeping the pins. W8A8 (activations quantized to
  int8: matmul 'int8' and 'cpu_int8') is llama.cpp's arithmetic, not float32's: it is a candidate under
  dtype="auto" or where the matmul is pinned to it, never under an explicit dtype="float32", which means f32
  compute as `dtype` does in vLLM.
- `resolve_quantization` says what quantization="auto" loads.

The matmul paths: 'xla' (XLA's dot on the loaded params), 'cpu' (the CPU layer-matmul kernel on panels packed
at start, model/panels.py), 'int8' (W8A8 through XLA's int8 dot on int8 weights, quant.with_int8_activations)
and 'cpu_int8' ('cpu' with every Q8_0 / Q4_0 / Q4_1 / int8 matrix packed for the CPU quantized-matmul kernel, and
every Q4_K / Q5_K / Q6_K / Q5_0 / Q5_1 one, mixed layers included, read by the K-quant kernel: kernels_cpu/kquant_matmul).

Imports jax only to ask the backend, and each kernel module only to ask whether it is built.
"""

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxinfer.config import ATTENTION_IMPLS
from jaxinfer.model import kv_pool as kvp
from jaxinfer.model.attention import CPU_IMPL, DETERMINISTIC_IMPL, DETERMINISTIC_PALLAS_IMPL
from kernels_cpu import layer_matmul as cpu_layer_matmul
from kernels_cpu import paged_attention as cpu_kernel
from kernels_cpu import quant_matmul as cpu_quant_matmul
from kernels_cpu.build import has_int8_vector_path, has_matmul_vector_path

W8A8_MATMULS = ("int8", "cpu_int8")  # activations quantized to int8: offered only under dtype="auto" or pinned


@dataclasses.dataclass(frozen=True)
class Impls:
    """What an engine runs: compute dtype, attention impl and matmul path; "auto" leaves a field to the tuner."""

    dtype: str = "auto"
    attention_impl: str = "auto"
    matmul_impl: str = "auto"

    @property
    def name(self) -> str:
        return f"{self.dtype}/{self.attention_impl}/{self.matmul_impl}"

    @property
    def all_pinned(self) -> bool:
        return "auto" not in (self.dtype, self.attention_impl, self.matmul_impl)

    def describe(self) -> str:
        return f"dtype {self.dtype}, attention {self.attention_impl}, matmul {self.matmul_impl}"

    def fits(self, pins: "Impls") -> bool:
        """Whether these impls keep `pins` (each pinned field equal)."""
        return all(pin in ("auto", value) for pin, value in zip(
            (pins.dtype, pins.attention_impl, pins.matmul_impl), (self.dtype, self.attention_impl, self.matmul_impl)))

    def impls(self) -> "Impls":
        """The plain value (a subclass, such as the tuner's Candidate, reduced to its three fields)."""
        return Impls(self.dtype, self.attention_impl, self.matmul_impl)


# ------------------------------------------------------------------ may it run here


def cpu_kernel_obstacle(dtype, *, on_mesh: bool = False, kv_cache_dtype: str | None = None, quantized: bool = False) -> str | None:
    """Why the CPU kernels cannot serve an engine, or None if they can. Attention and matmul share the rule
    (the engine packs weights for the layer-matmul kernel whenever the attention is the CPU kernel);
    `quantized`: the quantized-matmul kernel is needed too."""
    if jax.default_backend() != "cpu":
        return f"runs on the CPU backend only, not {jax.default_backend()!r}"
    if dtype is not None and jnp.dtype(dtype) != jnp.float32:
        return f"needs a float32 model, got {jnp.dtype(dtype)}"
    if kv_cache_dtype is not None:
        return f"reads an unquantized pool, got kv_cache_dtype={kv_cache_dtype!r}"
    if on_mesh:
        return "runs on one device, not on a mesh"
    kernels = (cpu_kernel, cpu_layer_matmul) + ((cpu_quant_matmul,) if quantized else ())
    return None if all(kernel.available() for kernel in kernels) else "could not be built (no C++ compiler?)"


def pallas_obstacle(dtype, kv_cache_dtype: str | None, *, page_size: int | None, head_dim: int | None, group_size: int) -> str | None:
    """Why the Pallas kernel cannot serve this engine, or None if it can: the kernel module owns its geometry rule."""
    if page_size is None or head_dim is None:
        raise ValueError("resolve_impl needs page_size and head_dim to ask the Pallas kernel whether it serves them")
    from kernels_pallas import paged_attention as kernel  # noqa: PLC0415  (GPU only; keeps CPU imports light)

    kv_dtype = None if kv_cache_dtype is None else kvp.KV_CODE_FORMATS[kv_cache_dtype][0]
    return kernel.supports(head_dim, page_size, group_size, dtype=dtype, kv_dtype=kv_dtype)


def resolve_impl(impl: str, *, deterministic: bool = False, dtype=None, kv_cache_dtype: str | None = None, tensor_parallel: int = 1,
                 page_size: int | None = None, head_dim: int | None = None, group_size: int = 1) -> str:
    """The impl `attention.attend` runs for an EngineConfig.attention_impl: 'reference', 'pallas' or 'cpu', or
    in deterministic mode DETERMINISTIC_IMPL or DETERMINISTIC_PALLAS_IMPL.

    'auto' picks the Pallas kernel on a GPU where the kernel says it serves the geometry (page_size, head_dim,
    group_size = query heads per kv head, the model's dtype if known, the pool's kv_cache_dtype); on a CPU, the
    CPU kernel where `cpu_kernel_obstacle` finds none (never in deterministic mode); else the jnp reference. An
    explicit 'pallas' or 'cpu' that cannot run raises, naming why."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    geometry = dict(page_size=page_size, head_dim=head_dim, group_size=group_size)
    cpu_obstacle = functools.partial(cpu_kernel_obstacle, dtype, on_mesh=tensor_parallel != 1, kv_cache_dtype=kv_cache_dtype)
    if impl == "auto":
        if jax.default_backend() == "gpu":
            impl = "pallas" if pallas_obstacle(dtype, kv_cache_dtype, **geometry) is None else "reference"
        else:
            impl = CPU_IMPL if not deterministic and not cpu_obstacle() else "reference"
    elif impl == "pallas" and (obstacle := pallas_obstacle(dtype, kv_cache_dtype, **geometry)):
        raise ValueError(f"attention_impl='pallas': the kernel {obstacle}; use attention_impl='auto' or 'reference'")
    elif impl == CPU_IMPL and (obstacle := cpu_obstacle()):
        raise ValueError(f"attention_impl='cpu' {obstacle}; use attention_impl='auto' or 'reference'")
    if deterministic:
        return DETERMINISTIC_PALLAS_IMPL if impl == "pallas" else DETERMINISTIC_IMPL
    return impl


def resolve_matmul_impl(matmul_impl: str, attention_impl: str, *, dtype: str, on_mesh: bool, int8_weights: bool = False,
                        affine_weights: bool = False, vector_path: bool | None = None) -> str:
    """'xla', 'cpu', 'int8' or 'cpu_int8' for an EngineConfig.matmul_impl, given the resolved attention impl.
    'auto' is 'cpu' exactly when the attention is the CPU kernel and this CPU has the layer-matmul kernel's wide
    path (`vector_path` None: kernels_cpu.build.has_matmul_vector_path(); without it XLA's dot is the faster one),
    else 'xla' (under 'cpu' quantized matrices stay as they are, only dense ones are packed). An explicit impl that
    cannot run raises ValueError, naming why, before anything is packed. `int8_weights`: the params hold int8-coded
    matrices (quantization='int8', or a GGUF's Q8_0 kept);
    `affine_weights`: they hold matrices the quantized kernel reads (int8, or a GGUF's Q8_0, Q4_0 or Q4_1)."""
    if matmul_impl == "auto":
        wide = has_matmul_vector_path() if vector_path is None else vector_path
        return "cpu" if attention_impl == CPU_IMPL and wide else "xla"
    if matmul_impl in ("cpu", "cpu_int8") and (obstacle := cpu_kernel_obstacle(dtype, on_mesh=on_mesh, quantized=matmul_impl == "cpu_int8")):
        raise ValueError(f"matmul_impl={matmul_impl!r}: the CPU kernels {obstacle}; use matmul_impl='auto' or 'xla'")
    if matmul_impl == "cpu_int8" and not affine_weights:
        raise ValueError("matmul_impl='cpu_int8' multiplies quantized weights (int8, Q8_0, Q4_0, Q4_1, K-quants, Q5_0, Q5_1) by int8 activations; load the model "
                         "with quantization='int8', or a GGUF with such tensors with quantization='gguf'")
    if matmul_impl == "int8" and not int8_weights:
        raise ValueError("matmul_impl='int8' multiplies int8 weights by int8 activations; load the model with quantization='int8' "
                         "(or a GGUF with Q8_0 tensors with quantization='gguf')")
    return matmul_impl


def packer(matmul_impl: str):
    """What the engine does to the params for a resolved matmul impl before stepping: 'cpu' packs the dense
    f32 matrices into the layer-matmul kernel's panels, 'cpu_int8' also the affine quantized ones into the
    quantized kernel's (both new arrays), 'int8' marks the int8 matrices W8A8 (the same arrays). K-quant
    matrices packed at load (panel_tensors.KQuantPanelTensor) are read by the K-quant kernel under 'cpu_int8'
    and dequantized a layer at a time under every other impl (marked read="dense": the same arrays)."""
    from jaxinfer.model import panels, quant  # noqa: PLC0415

    dense_read = functools.partial(panels.with_read, read="dense")
    return {"cpu": panels.pack_panels, "cpu_int8": functools.partial(panels.pack_panels, quantized=True),
            "int8": lambda params: dense_read(quant.with_int8_activations(params))}.get(matmul_impl, dense_read)


# ------------------------------------------------------------------ what the tuner may time


def _backend_combos(backend: str, *, int8_weights: bool, affine_weights: bool) -> list[tuple[str, str, str]]:
    """Every (dtype, attention, matmul) a backend can run for weights of these kinds. CPU: f32 with every mix
    of the CPU kernels and XLA/jnp, bf16 through XLA (the CPU kernels are f32 only), W8A8 through XLA's int8
    dot where the weights hold int8 codes, and the quantized-matmul kernel where they hold int8, Q8_0, Q4_0 or
    Q4_1 matrices. GPU: f32 and bf16 through XLA, bf16 with the Pallas decode kernel, and bf16 W8A8."""
    if backend != "cpu":
        return [("float32", "reference", "xla"), ("bfloat16", "reference", "xla"), ("bfloat16", "pallas", "xla")] + (
            [("bfloat16", "reference", "int8")] if int8_weights else [])
    combos = [("float32", a, m) for a in ("reference", CPU_IMPL) for m in ("xla", "cpu")] + [("bfloat16", "reference", "xla")]
    combos += [("float32", a, "int8") for a in ("reference", CPU_IMPL)] if int8_weights else []
    return combos + ([("float32", a, "cpu_int8") for a in ("reference", CPU_IMPL)] if affine_weights else [])


def candidates(pins: Impls, backend: str | None = None, *, int8_weights: bool = False, affine_weights: bool = False,
               vector_path: bool | None = None) -> list[Impls]:
    """The impls of this backend the tuner may time, keeping the pins. W8A8 matmuls (bench_quant_w8a8.json:
    +0.62% perplexity over f32 on SmolLM2, inside the 1% the tuner may trade for speed) only under dtype="auto"
    or a matmul pinned to one: an explicit dtype means that compute dtype for every matmul. A pinned float16 is
    offered through XLA. The dense layer-matmul kernel (matmul 'cpu') only on a CPU with its wide path (`vector_path`
    None: kernels_cpu.build.has_matmul_vector_path()) or pinned: its AVX2 tiles lose to XLA's dot (docs/tuning.md:
    13x XLA's probe prefill on an AMD EPYC with AVX2), so timing it there only costs its compile and probe."""
    backend = backend or jax.default_backend()
    combos = _backend_combos(backend, int8_weights=int8_weights, affine_weights=affine_weights)
    if pins.dtype != "auto" and pins.matmul_impl not in W8A8_MATMULS:
        combos = [c for c in combos if c[2] not in W8A8_MATMULS]
    if backend == "cpu" and pins.matmul_impl != "cpu" and not (has_matmul_vector_path() if vector_path is None else vector_path):
        combos = [c for c in combos if c[2] != "cpu"]
    combos += [] if pins.dtype in ("auto", "float32", "bfloat16") else [(pins.dtype, "reference", "xla")]
    return [impls for impls in (Impls(*combo) for combo in combos) if impls.fits(pins)]


def kquant_kernel_may_run(pins: Impls, *, on_mesh: bool = False) -> bool:
    """Whether the CPU K-quant kernel (matmul 'cpu_int8') may multiply this engine's weights: the CPU backend,
    one device, the kernels built, a float32 (or auto) dtype and the matmul at 'auto' or 'cpu_int8'. Loading
    then packs K-quant matrices into its panels as it reads them (loading.load_model's `kquant_panels`)."""
    if pins.matmul_impl not in ("auto", "cpu_int8") or pins.dtype not in ("auto", "float32"):
        return False
    return cpu_kernel_obstacle("float32", on_mesh=on_mesh, quantized=True) is None


def resolve_quantization(quantization: str | None, model_path, pins: Impls, *, on_mesh: bool = False, tuning: bool = True) -> str | None:
    """What loading gets for a LoadOptions.quantization: 'auto' (the default) keeps a GGUF file's blocks
    ('gguf') where the CPU quantized-matmul kernel may run them (matmul 'cpu_int8': a CPU backend, one device,
    the kernel built, and the matmul pinned to 'cpu_int8', or left at 'auto' under dtype="auto" with tuning on,
    `tuning`), and loads dense (None) everywhere else. The tuner then runs every other candidate on the dense
    weights and keeps whichever is fastest."""
    if quantization != "auto":
        return quantization
    gguf_file = model_path is not None and Path(model_path).is_file()
    kernel_may_run = pins.matmul_impl == "cpu_int8" or (pins.matmul_impl == "auto" and pins.dtype == "auto" and tuning)
    dtype = "float32" if pins.dtype == "auto" else pins.dtype
    usable = gguf_file and kernel_may_run and cpu_kernel_obstacle(dtype, on_mesh=on_mesh, quantized=True) is None
    return "gguf" if usable else None


def kernel_first(candidates: list, vector_path: bool | None = None, *, dense_fits: bool = False) -> list:
    """The tuner's `candidates` (tuning.Candidate) with matmul 'cpu_int8' (it multiplies kept blocks as they are) first,
    its score pruning the slower ones (tuning.PRUNE_FACTOR). On a CPU without its vector path (`vector_path` None:
    kernels_cpu.build.has_int8_vector_path()), where its int8 dots are scalar loops and it is the slow one, last; left
    out there where the blocks' dense copy fits (`dense_fits`) and another candidate remains."""
    kernel, others = [c for c in candidates if c.matmul_impl == "cpu_int8"], [c for c in candidates if c.matmul_impl != "cpu_int8"]
    if has_int8_vector_path() if vector_path is None else vector_path:
        return kernel + others
    return others if dense_fits and others else others + kernel
