"""`make chaos`: faults and bad inputs against the real local stack, proving every request is answered and billed once."""
