"""How a model is loaded: `LoadOptions`, the one validated set of load options (compute dtype, weight
quantization, int4 group size, tensor and data parallelism, control-token parsing) that `LLM`, the CLI
and the Ray actors share, and the choices they are checked against (the vocabularies are config.py's).
The CLI takes its choices and defaults from here. Imports config and validation only; no jax at import
(the CLI's --help stays fast): the device count is read only when a parallel layout needs checking.
"""

import dataclasses

from jaxinfer.config import DEFAULT_INT4_GROUP_SIZE, DTYPES, INT4_GROUP_SIZES, QUANTIZATIONS
from jaxinfer.validation import FieldError

# Compute dtypes a user may ask for. "auto" (the default, vLLM's dtype="auto" convention): the runtime tuner
# (tuning.py) measures float32 and bfloat16 on this machine and keeps the faster one that passes its numerics
# check against float32; with JAXINFER_TUNE=0, float32. A dtype given explicitly is pinned, never changed.
DTYPE_CHOICES = ("auto", *DTYPES)
# QUANTIZATIONS, INT4_GROUP_SIZES and DEFAULT_INT4_GROUP_SIZE are config.py's (the model reads them too);
# they are named here as well because the CLI takes every load choice from this module.
__all__ = ["DEFAULT_INT4_GROUP_SIZE", "DTYPE_CHOICES", "INT4_GROUP_SIZES", "QUANTIZATIONS", "LoadOptions", "check_parallel", "check_quantization", "check_tensor_parallel"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """Validated where built; errors name the field (`FieldError`), which the CLI renames to its flag."""

    dtype: str = "auto"  # compute dtype: auto (tuned, see DTYPE_CHOICES), float32, bfloat16 or float16
    quantization: str | None = "auto"  # weights held on the device: auto (see QUANTIZATIONS), None (dense), gguf, int8 or int4
    group_size: int | None = None  # input elements per int4 scale (int4 only; None: DEFAULT_INT4_GROUP_SIZE)
    tensor_parallel: int = 1  # devices one replica is sharded over
    data_parallel: int = 1  # model replicas, each on its own tensor_parallel devices
    parse_special: bool | None = None  # control-token text in input: None prompts only, False never, True also in chat content

    def __post_init__(self):
        if self.dtype not in DTYPE_CHOICES:
            raise FieldError("dtype", f"must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        check_quantization(self.quantization, self.group_size)
        check_parallel(self.tensor_parallel, self.data_parallel)
        if self.parse_special not in (None, True, False):
            raise FieldError("parse_special", f"must be None, True or False, got {self.parse_special!r}")

    @property
    def on_mesh(self) -> bool:
        """Whether the replicas live on meshes (weights then go from host memory to each device's shards)."""
        return self.tensor_parallel > 1 or self.data_parallel > 1

    @property
    def load_kwargs(self) -> dict:
        """loading.load_model's keyword arguments. An "auto" dtype loads float32 (the tuner's reference);
        the tuner casts the loaded params if it picks another dtype. An "auto" quantization loads dense here:
        loading.load_for_engine resolves it where the kernel may run."""
        group = {} if self.group_size is None else {"group_size": self.group_size}
        quantization = None if self.quantization == "auto" else self.quantization
        return {"dtype": "float32" if self.dtype == "auto" else self.dtype, "quantization": quantization, "on_host": self.on_mesh, **group}


def check_quantization(value, group_size: int | None = None) -> str | None:
    """The weight quantization and its int4 group size (None: the default, DEFAULT_INT4_GROUP_SIZE)."""
    if value is not None and (not isinstance(value, str) or value not in QUANTIZATIONS):
        raise FieldError("quantization", f"must be None or one of {QUANTIZATIONS}, got {value!r}")
    if group_size is not None:
        if value != "int4":
            raise FieldError("group_size", f"applies to quantization='int4' only, got quantization={value!r}")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in INT4_GROUP_SIZES:  # 64.0 == 64, but reshapes fail
            raise FieldError("group_size", f"must be one of {INT4_GROUP_SIZES}, got {group_size!r}")
    return value


def check_parallel(tensor_parallel, data_parallel=1, *, num_devices: int | None = None) -> tuple[int, int]:
    """(tensor_parallel, data_parallel), each a positive integer; together they need tp x dp devices."""
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise FieldError("data_parallel", f"must be a positive integer, got {data_parallel!r}")
    check_tensor_parallel(tensor_parallel, num_devices=num_devices)
    if data_parallel > 1:
        if num_devices is None:
            import jax

            num_devices = len(jax.devices())
        if tensor_parallel * data_parallel > num_devices:
            raise FieldError("data_parallel", f"({data_parallel}) x tensor_parallel ({tensor_parallel}) needs {tensor_parallel * data_parallel} devices; {num_devices} available")
    return tensor_parallel, data_parallel


def check_tensor_parallel(value, *, num_devices: int | None = None) -> int:
    """Devices of the one model replica's `model` mesh: a positive integer, at most the devices JAX sees
    (on CPU, simulate more with XLA_FLAGS=--xla_force_host_platform_device_count=N). Heads, MLP width or
    vocabulary that do not divide it are replicated (sharding.py), never an error. The Pallas decode
    kernel runs under shard_map on each device's heads (sharding.on_local_heads)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise FieldError("tensor_parallel", f"must be a positive integer, got {value!r}")
    if value == 1:
        return value
    if num_devices is None:
        import jax

        num_devices = len(jax.devices())
    if value > num_devices:
        raise FieldError("tensor_parallel", f"({value}) exceeds the {num_devices} available device(s); on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={value} simulates them")
    return value
