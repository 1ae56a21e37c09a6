"""Weight transports: how trainer rank 0's weights reach an inference worker.

In: the trainer's parameters, streamed chunk by chunk (`chunks.plan_chunks`) into two
reused slots. Out: per worker, the same bytes as (name, tensor) views it loads.
One interface (`base.Receiver`), one file per way the bytes travel:
- `broadcast`: a torch.distributed group (gloo on CPU, NCCL on GPU), any node;
- `shm`: slots in a /dev/shm file the worker maps (same node, CPU);
- `cuda_ipc`: slots in GPU memory the worker opens by handle (same GPU);
and `select.choose_transport` picks one per worker and says why.
"""
