#!/usr/bin/env bash
# Print the CMAKE_ARGS that build llama-cpp-python for this machine without GGML_NATIVE.
# A native build segfaults in llama_decode on Intel CPUs with AMX, so the SIMD levels are named
# one by one from /proc/cpuinfo's flags and the AMX kernels stay off. The build recorded in
# .venv-ref/llama_cpp_build.txt says which flags ran, for the benchmark results.
set -u
flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
has() { [[ "$flags" == *" $1 "* ]]; }
args="-DGGML_NATIVE=OFF"
on_if() { if has "$1"; then args+=" -D$2=ON"; else args+=" -D$2=OFF"; fi; }
on_if avx GGML_AVX
on_if avx2 GGML_AVX2
on_if fma GGML_FMA
on_if f16c GGML_F16C
on_if bmi2 GGML_BMI2
on_if avx_vnni GGML_AVX_VNNI
on_if avx512f GGML_AVX512
on_if avx512vbmi GGML_AVX512_VBMI
on_if avx512_vnni GGML_AVX512_VNNI
on_if avx512_bf16 GGML_AVX512_BF16
args+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
echo "$args"
