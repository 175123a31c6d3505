"""Running on several devices and faster: strategies and sharding (FSDP2 / FSDP1 / DDP, ``distributed``) and
regional ``torch.compile`` of the training forwards (``compiling``)."""
