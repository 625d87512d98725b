"""Pure device functions: params and the weight table, the forward pass, attention, the KV pool arrays,
quantization, sampling, sharding and the CPU kernels' weight panels. Nothing here imports scheduling/ or engine/."""
