"""The mechanisms of ``distributed`` (``accelfn.parts.sharding`` calls them): ``ddp`` and
``fsdp`` (wrapping, the step function run as the forward), ``mesh`` (the process layout and
its checks), ``plans`` (tensor-parallel plans), ``muon`` (Muon over sharded parameters),
``errors`` (torch.distributed's failures said in accelfn's terms: ``DistributedError``) and
``ft`` (replica groups made fault tolerant by torchft: ``FaultTolerance``)."""
