"""A Hugging Face ``Trainer`` job (DDP through Accelerate), instrumented with one callback.

A small GPT-2 built from a config in code (nothing is downloaded), trained on random tokens;
``Trainer(callbacks=[StragglerCallback()])`` makes every rank report its compute and its wait
in DDP's all-reduce, and each checkpoint the Trainer writes (every --ckpt-every steps, to a
shared directory; a restarted job resumes from the last one). CPU here, GPUs where present.

    srun python examples/hf_train.py --steps 300 --ckpt-dir /shared/ckpt
"""

from __future__ import annotations

import _launch
import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from slurm_plugin.telemetry.hf import StragglerCallback


class _Tokens(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, size: int, length: int, vocab: int) -> None:
        self.size, self.length, self.vocab = size, length, vocab

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(index)
        ids = torch.randint(0, self.vocab, (self.length,), generator=gen)
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    args = _launch.arguments(__doc__, batch=8, width=128).parse_args()
    torch.set_num_threads(1)
    _launch.torch_env()  # what torchrun would set; Accelerate initialises the group
    config = GPT2Config(n_layer=2, n_embd=args.width, n_head=4, vocab_size=256, n_positions=32)
    training = TrainingArguments(
        output_dir=str(args.ckpt_dir),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        save_strategy="steps",
        save_steps=args.ckpt_every,
        logging_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        ddp_backend=None if torch.cuda.is_available() else "gloo",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=GPT2LMHeadModel(config),
        args=training,
        train_dataset=_Tokens(args.steps * args.batch, 32, config.vocab_size),
        callbacks=[StragglerCallback()],
    )
    last = get_last_checkpoint(str(args.ckpt_dir)) if args.ckpt_dir.exists() else None
    if last and trainer.is_world_process_zero():
        print("resuming from", last, flush=True)
    trainer.train(resume_from_checkpoint=last)
    if trainer.is_world_process_zero():
        print(f"done: {trainer.state.global_step} steps", flush=True)
        (args.ckpt_dir / "done").write_text(f"{trainer.state.global_step}\n")


if __name__ == "__main__":
    main()
