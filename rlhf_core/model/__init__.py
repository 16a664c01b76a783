"""The policy model and what is done to it, below the trainer and the rollout engines:

    policy.py     load a policy from a directory, the tiny demo policy, the stop set, dropout off
    directory.py  what a model directory holds, read without torch (config, tokenizer, weight headers, LoRA targets)
    chat.py       the small local chat model (byte-level BPE, ChatML with a tool-call format)
    lora.py       LoRA adapters (peft): wrap, adapter tensors for syncs and checkpoints, merge for export
    sharding.py   FSDP2 sharding of a model over a trainer group, its rows and gathers
    weights.py    whole tensors into a model (full, LoRA or sharded): checkpoints, the trainer, the critic

Importing this package imports nothing (`rlhf_core.models` keeps the public names of policy.py).
"""
