"""Weight sync: the publisher (parameter broadcaster), the object-store and collective
transports, bucket plans and the NCCL/gloo group."""
