"""A minimal fine-tuning loop for a causal language model with PyTorch and transformers."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


@dataclass
class TrainArgs:
    model_name: str = "gpt2"
    data_path: Path = Path("data/train.txt")
    output_dir: Path = Path("outputs/run")
    seq_len: int = 512
    batch_size: int = 8
    lr: float = 3e-4
    warmup_steps: int = 100
    max_steps: int = 2_000
    grad_accum: int = 4
    tags: list[str] = field(default_factory=list)


class TextChunks(Dataset):
    def __init__(self, ids: torch.Tensor, seq_len: int) -> None:
        self.ids = ids
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (self.ids.numel() - 1) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        chunk = self.ids[i * self.seq_len:(i + 1) * self.seq_len + 1]
        return {"input_ids": chunk[:-1], "labels": chunk[1:]}


def load_chunks(args: TrainArgs, tokenizer) -> TextChunks:
    text = args.data_path.read_text(encoding="utf-8")
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    print(f"loaded {len(text):,} characters as {ids.numel():,} tokens from {args.data_path}")
    return TextChunks(ids, args.seq_len)


@torch.no_grad()
def evaluate(model, loader: DataLoader, device: torch.device) -> float:
    model.eval()
    total, count = 0.0, 0
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")
        total += loss.item()
        count += batch["labels"].numel()
    model.train()
    return math.exp(total / max(count, 1))


def train(args: TrainArgs) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    model = AutoModelForCausalLM.from_pretrained(args.model_name, torch_dtype=torch.bfloat16).to(device)
    dataset = load_chunks(args, tokenizer)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)
    step = 0
    while step < args.max_steps:
        for i, batch in enumerate(loader):
            batch = {k: v.to(device) for k, v in batch.items()}
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(input_ids=batch["input_ids"]).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())
            (loss / args.grad_accum).backward()
            if (i + 1) % args.grad_accum != 0:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 50 == 0:
                print(f"step {step:>5} | loss {loss.item():.4f} | lr {scheduler.get_last_lr()[0]:.2e}")
            if step >= args.max_steps:
                break
    args.output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)
    print(f"saved to {args.output_dir}")


if __name__ == "__main__":
    train(TrainArgs())
