"""Buffer service: durable store of one agent's samples; releases GRPO-group batches."""
