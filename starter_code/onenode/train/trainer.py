"""The A2 trainer: a recipe in, a token-budgeted run out (checkpoints, metrics, final model, manifest).

    trainer = Trainer(load_recipe("a2_pretrain/recipes/tiny.yaml"), out_dir="runs/tiny")
    summary = trainer.fit()

The token budget is a hard rule: the run takes `token_budget // (global_batch_size * seq_len)`
optimizer steps, so it never sees a token more than the budget; every token fed to the model
counts (repeats included). The count and the loader's data-order digest go into every checkpoint
and into `run_manifest.json`, which the grader audits. Runs under torchrun as well as alone.

A run is verifiable: it checkpoints its seeded initialisation (step 0) before the first step,
and every checkpoint's meta.json chains it to the one before (its weights hash and the previous
checkpoint's), with what replaying the span between them needs (seed, layout, versions, data
position; `checkpoint.py`). Resuming is exact, so the grader replays spans of the chain and must
get the later checkpoint back.

A DiLoCo run (`parallel.diloco`) is one such trainer per replica group, each on its own slice of
the data: the counts are of every group's tokens (the global batch spans the groups), checkpoints
fall on syncs, and a group but the first writes its folder in `replica_{r}/` under the run's.

Run folder: `metrics.jsonl` (+ `tensorboard/`), `checkpoints/step_*/`, `final/` (transformers
layout + run_manifest.json), `run_manifest.json`, `recipe.yaml` (the resolved recipe),
`loss_curves.png` (with matplotlib).
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from ..model import count_parameters, mamba_ssm_scan
from ..parallel.distributed import mean_over_ranks
from ..parallel.float8 import summary as float8_summary
from .assembly import assemble
from .checkpoint import (
    export_final,
    full_model_state_dict,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
    weights_sha256,
    write_json,
)
from .logging import LOG_FIELDS, MetricsLog, environment, git_commit, read_metrics
from .plots import plot_loss_curves
from .recipe import Recipe, RecipeError
from .schedule import lr_factor, set_lr


class Trainer:
    def __init__(self, recipe: Recipe, out_dir: str | Path, resume: str | None = "auto"):
        """`resume`: "auto" (the latest checkpoint in out_dir, if any), None (start fresh) or a
        checkpoint folder."""
        self.recipe = recipe
        self.run = assemble(recipe)
        self.replica, self.diloco = self.run.replica, self.run.diloco
        self.out_dir = Path(out_dir) / f"replica_{self.replica}" if self.replica else Path(out_dir)
        self.rank, self.world = self.run.rank, self.run.layout.world
        self.device, self.config, self.total_steps = self.run.device, self.run.config, recipe.total_steps
        self.parallel, self.optimizer, self.balancer = self.run.parallel, self.run.optimizer, self.run.balancer
        self.dp, self.micro_batch, self.accumulation = (self.run.layout.dp, self.run.layout.micro_batch,
                                                        self.run.layout.accumulation)
        self.dp_group, self.dp_rank = self.run.dp_group, self.run.dp_rank
        # the data falls in slices over every data-parallel rank of every DiLoCo replica group
        self.data_rank, self.data_ranks = self.replica * self.dp + self.dp_rank, self.run.layout.replicas * self.dp
        self.loader = self._loader("train")

        self.step = 0
        self.tokens_seen = 0
        self.losses: list[float] = []  # every step's training loss (mean over data-parallel ranks)
        self.val_loss: float | None = None
        self._flops_per_token = self._matmul_flops_per_token()
        self._speeds: list[dict] = []  # the logged throughput records of this process
        self.previous_checkpoint: dict | None = None  # the chain's last link: {"step", "weights_sha256"}
        resumed = self._maybe_resume(resume)
        self.log = MetricsLog(self.out_dir, recipe.log.tensorboard, resume_step=self.step if resumed else None) \
            if self.rank == 0 else None

    # -- setup -----------------------------------------------------------------------------
    def _loader(self, split: str):
        d, t = self.recipe.data, self.recipe.train
        if d.source == "synthetic":
            from .synthetic import SyntheticLoader

            return SyntheticLoader(self.config.vocab_size, t.seq_len, self.micro_batch, seed=self.recipe.seed,
                                   rank=self.data_rank, world_size=self.data_ranks, split=split)
        from ..data import MixtureLoader

        loader = MixtureLoader(self._data_dir(), self.micro_batch, t.seq_len, split=split,
                               weights=d.mixture or None, seed=self.recipe.seed,
                               rank=self.data_rank, world_size=self.data_ranks)
        return loader

    def _data_dir(self) -> Path:
        """The built data folder: `data.path` itself, or the cached build of a data config."""
        d = self.recipe.data
        if d.source == "shards":
            folder = Path(d.path)
        elif d.source == "megatron":
            from ..data.megatron_source import megatron_data_folder

            try:
                folder = megatron_data_folder(d.path)
            except (OSError, ValueError, RuntimeError) as e:
                raise RecipeError(f"recipe: data.source megatron, data.path {d.path}: {e}") from None
        else:
            from ..data import build
            from ..data.corpus import cache_dir, cache_lock

            config = Path(d.path)
            if not config.is_file():
                raise RecipeError(f"recipe: data.path: no data config at {config}")
            folder = cache_dir() / "datasets" / hashlib.sha256(config.read_bytes()).hexdigest()[:16]
            if not (folder / "manifest.json").is_file():
                if self.rank == 0:
                    with cache_lock(f"datasets-{folder.name}"):
                        if not (folder / "manifest.json").is_file():
                            build(config, folder)
                if self.world > 1:
                    dist.barrier()
        manifest = folder / "manifest.json"
        if not manifest.is_file():
            raise RecipeError(f"recipe: data.path: {folder} is not a built data folder (no manifest.json): "
                              "run `onenode data build CONFIG --out FOLDER` first")
        vocab = json.loads(manifest.read_text())["tokenizer"]["vocab_size"]
        if vocab > self.config.vocab_size:
            raise RecipeError(f"recipe: model.vocab_size {self.config.vocab_size} is smaller than the data's "
                              f"tokenizer ({vocab} tokens): raise it")
        return folder

    def _matmul_flops_per_token(self) -> float | None:
        try:
            from ..flops import model_flops
        except ImportError:
            return None
        return model_flops(self.config, self.recipe.train.seq_len).matmul_flops_per_token

    def _maybe_resume(self, resume) -> bool:
        if resume is None:
            return False
        if resume == "auto":
            path = latest_checkpoint(self.out_dir / "checkpoints")
            if path is None:
                return False
        else:
            path = Path(resume)
            if (path / "checkpoints").is_dir():  # a run folder: its latest complete checkpoint
                path = latest_checkpoint(path / "checkpoints") or path / "checkpoints"
        meta, state = load_checkpoint(path, self.parallel, self.optimizer)
        self.take_kernel_tiles(meta, path)
        self.previous_checkpoint = {"step": meta["step"], "weights_sha256": meta.get("weights_sha256")}
        self.step, self.tokens_seen, self.losses = state["step"], state["tokens_seen"], list(state["losses"])
        self.loader.load_state_dict(state["loader"])
        set_rng_state(state["rng"])
        if self.diloco is not None:
            self.diloco.load_state_dict(state["diloco"])
        if self.rank == 0:
            print(f"resumed from {path} at step {self.step} ({self.tokens_seen:,} tokens)")
        return True

    def take_kernel_tiles(self, meta: dict, path: Path) -> None:
        """Take this process's record of mamba_ssm's tuned tiles from a checkpoint's `meta` (if it has
        one): the same tiles sum in the same order. A replayed span takes its end's, which holds the
        choices made during it (the chain's first checkpoint is written before any kernel ran)."""
        if "kernel_tiles" not in meta:
            return
        per_rank = meta["kernel_tiles"]
        try:
            if not isinstance(per_rank, list) or len(per_rank) != self.world:
                raise ValueError(f"recorded for {len(per_rank) if isinstance(per_rank, list) else '?'} processes, "
                                 f"this run has {self.world}: run it with the layout it trained with")
            mamba_ssm_scan.use_tiles(per_rank[self.rank])
        except ValueError as e:
            raise RecipeError(f"checkpoint {path}: {e}") from None

    # -- one step ------------------------------------------------------------------------------
    def train_step(self) -> dict:
        """One optimizer step over a global batch (this rank's micro-batches) at the scheduled lr,
        then the routers' rebalancing; the record logged for it."""
        factor = lr_factor(self.recipe.schedule, self.step, self.total_steps)
        lr = set_lr(self.optimizer, self.recipe.optimizer.lr, factor)
        micro_batches = [next(self.loader) for _ in range(self.accumulation)]
        input_ids, labels = (torch.cat(parts).to(self.device, non_blocking=True) for parts in zip(*micro_batches))
        out = self.run.step(input_ids, labels)
        self.step += 1
        self.tokens_seen += self.recipe.tokens_per_step
        loss = mean_over_ranks(out.pop("loss"), self.device)
        return {"step": self.step, "tokens": self.tokens_seen, "loss": loss, "lr": lr, **out}

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean loss over `eval.batches` held-out batches (the same batches every time); None
        for pipeline runs and data without a validation split."""
        model = self.parallel.model
        if model is None:
            return None  # pipeline stages have no single forward to evaluate
        try:
            loader = self._loader("val")
        except ValueError:  # a data folder built with val_fraction 0
            return None
        model.eval()
        total = 0.0
        for _ in range(self.recipe.eval.batches):
            input_ids, labels = (t.to(self.device) for t in next(loader))
            total += float(model(input_ids, labels=labels).loss)
        model.train()
        self.balancer.finish_step(0.0)  # routing during eval is not training load
        return mean_over_ranks(total / self.recipe.eval.batches, self.device)

    # -- the run -------------------------------------------------------------------------------
    def _trainer_state(self) -> dict:
        state = {"step": self.step, "tokens_seen": self.tokens_seen, "losses": self.losses,
                 "loader": self.loader.state_dict(), "rng": rng_state()}
        if self.diloco is not None:
            state["diloco"] = self.diloco.state_dict()
        return state

    def save(self) -> Path:
        """Checkpoint this step, chained to the previous checkpoint (collective)."""
        weights = self.weights_sha256()
        meta = {"tokens_seen": self.tokens_seen, **self._data_digest(), "recipe": self.recipe.name,
                "weights_sha256": weights, "previous": self.previous_checkpoint, **self.replay_record()}
        path = save_checkpoint(self.out_dir / "checkpoints", self.step, self.parallel, self.optimizer,
                               self._trainer_state(), meta, keep_last=self.recipe.checkpoint.keep_last)
        self.previous_checkpoint = {"step": self.step, "weights_sha256": weights}
        return path

    def weights_sha256(self) -> str | None:
        """The chain's hash of the whole model (collective; None on ranks but 0, and for pipeline
        runs, whose stages live on different ranks)."""
        if self.parallel.model is None:
            return None
        state = full_model_state_dict(self.parallel.model)
        return weights_sha256(state) if self.rank == 0 else None

    def replay_record(self) -> dict:
        """What re-running a span from this checkpoint needs besides its files: the recipe it
        trains (`Recipe.training_sha256`), the seed, the layout (the same on the replaying
        machine gives the same bits), the versions and hardware, rank 0's data position, and the
        tiles mamba_ssm's kernels chose where they tuned themselves (collective)."""
        p = self.recipe.parallel
        return {**self._kernel_tiles(), "training_sha256": self.recipe.training_sha256, "seed": self.recipe.seed,
                "layout": {"world_size": self.world, "dp": self.dp, "ep": p.ep, "pp": p.pp,
                           "micro_batch_size": self.micro_batch, "accumulation": self.accumulation,
                           "device": self.device.type, "threads": torch.get_num_threads()},
                **environment(self.world), "commit": git_commit(), "loader": self.loader.state_dict()}

    def manifest(self, status: str, wall_s: float) -> dict:
        total, active = count_parameters(self.config)
        tail = self.losses[-10:]
        return {
            "status": status,
            "recipe_path": self.recipe.source_path,
            "recipe": self.recipe.to_dict(),
            "model_config": self.config.to_hf_dict(),
            "parameters": {"total": total, "active": active},
            "commit": git_commit(),
            **environment(self.world),
            "token_budget": self.recipe.train.token_budget,
            "tokens_seen": self.tokens_seen,
            "tokens_per_step": self.recipe.tokens_per_step,
            "steps": self.step,
            "total_steps": self.total_steps,
            **self._data_digest(),
            "data_tokens_served": self._sum_over_replicas(self._sum_over_dp(self.loader.tokens_served)),
            **({"diloco": {"replica_group": self.replica}} if self.diloco else {}),
            "final_losses": {
                "train": self.losses[-1] if self.losses else None,
                "train_mean_last_10": sum(tail) / len(tail) if tail else None,
                "val": self.val_loss,
            },
            "wall_time_s": wall_s,
            "throughput": self._throughput(),
        }

    def _throughput(self) -> dict:
        """Median tokens/s (and MFU on GPUs) over the logged intervals, the first (warm-up) left out."""
        measured = self._speeds[1:] or self._speeds
        if not measured:
            return {}
        out = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in measured),
               "intervals": len(measured), "warmup_interval_excluded": len(self._speeds) > 1}
        if all("mfu" in r for r in measured):
            out["mfu"] = statistics.median(r["mfu"] for r in measured)
            out["mfu_convention"] = "tensor-core matmul FLOPs (onenode.flops) / (GPUs x 989 TFLOP/s bf16)"
        out["tokens_per_s_per_rank"] = out["tokens_per_s"] / self.world
        return out

    def _kernel_tiles(self) -> dict:
        """mamba_ssm's tuned tiles, a record per rank (each process tunes its own kernels); {} where
        none tuned (the torch scan, or one config a kernel)."""
        tiles = mamba_ssm_scan.chosen_tiles()
        per_rank = [tiles]
        if self.world > 1:
            per_rank = [None] * self.world
            dist.all_gather_object(per_rank, tiles)
        return {"kernel_tiles": per_rank} if any(per_rank) else {}

    def _data_digest(self) -> dict:
        """The data-order digest; with several data-parallel ranks, one over theirs in rank order."""
        if self.world == 1:
            return {"data_digest": self.loader.order_digest}
        digests = [None] * self.dp
        dist.all_gather_object(digests, self.loader.order_digest, group=self.dp_group)
        combined = hashlib.sha256("".join(digests).encode()).hexdigest()
        return {"data_digest": combined, "data_digest_per_rank": digests}

    def _sum_over_dp(self, value: int) -> int:
        """Tokens served by every data-parallel replica together."""
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.dp_group)
        return int(t.item())

    def _sum_over_replicas(self, value: int) -> int:
        """Tokens served by every DiLoCo replica group together (collective over the groups)."""
        return value if self.diloco is None else round(self.diloco.sum_over_groups(value))

    @staticmethod
    def _log_line(record: dict, end_step: int, seconds_per_step: float) -> str:
        parts = [f"step {record['step']}/{end_step}", f"tokens {record['tokens']:,}"]
        for key, (fmt, _) in LOG_FIELDS.items():
            if fmt is not None and record.get(key) is not None:
                parts.append(f"{key} {record[key]:{fmt}}")
        eta = seconds_per_step * (end_step - record["step"])
        parts.append(f"eta {int(eta // 3600)}:{int(eta % 3600 // 60):02d}:{int(eta % 60):02d}")
        return " | ".join(parts)

    def _progress(self):
        if self.rank != 0 or not self.recipe.log.progress_bar:
            return None
        from tqdm.auto import tqdm

        # disable=None: no bar when stderr is not a terminal (logs of batch jobs stay readable)
        return tqdm(total=self.total_steps, initial=self.step, desc=self.recipe.name, unit="step",
                    dynamic_ncols=True, disable=None)

    def fit(self, stop_after_steps: int | None = None) -> dict:
        """Train to the token budget (or stop, with a checkpoint, after `stop_after_steps`)."""
        r = self.recipe
        if self.rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "recipe.yaml").write_text(yaml.safe_dump(r.to_dict(), sort_keys=False))
            if self.log.note:
                print(self.log.note)
            if self.run.float8:
                print(float8_summary(self.run.float8))
        if r.checkpoint.enabled and self.previous_checkpoint is None:
            self.save()  # the seeded initialisation: the chain's first link
        bar = self._progress()
        tokens_per_s = 0.0
        start, interval_start, interval_tokens = time.perf_counter(), time.perf_counter(), 0
        first_step = self.step
        end_step = self.total_steps if stop_after_steps is None else min(self.total_steps, stop_after_steps)
        while self.step < end_step:
            record = self.train_step()
            self.losses.append(record["loss"])
            interval_tokens += r.tokens_per_step
            last = self.step == end_step
            if r.eval.every_steps and self.step % r.eval.every_steps == 0 and not last:
                record["val_loss"] = self.val_loss = self.evaluate()
            if self.step % r.log.every_steps == 0 or last or "val_loss" in record:
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - interval_start
                record["tokens_per_s"] = tokens_per_s = interval_tokens / elapsed
                if self._flops_per_token and self.device.type == "cuda":
                    from ..flops import mfu

                    record["mfu"] = mfu(record["tokens_per_s"], self._flops_per_token, n_gpus=self.world)
                interval_start, interval_tokens = time.perf_counter(), 0
                self._speeds.append(record)
                if self.log:
                    self.log.log(record)
                    if bar is None or bar.disable:  # batch jobs: one line per logged step instead
                        seconds_per_step = (time.perf_counter() - start) / (self.step - first_step)
                        print(self._log_line(record, end_step, seconds_per_step), flush=True)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{record['loss']:.3f}" if record["loss"] is not None else "-",
                                tok_s=f"{tokens_per_s:.0f}")
            every = r.checkpoint.every_steps
            if r.checkpoint.enabled and every and self.step % every == 0 and not last:
                self.save()
        if bar is not None:
            bar.close()
        finished = self.step >= self.total_steps
        if finished:
            self.val_loss = self.evaluate()
            if self.log:
                self.log.log({"step": self.step, "tokens": self.tokens_seen, "val_loss": self.val_loss})
        if r.checkpoint.enabled and self.step != self.previous_checkpoint["step"]:
            self.save()
        manifest = self.manifest("finished" if finished else "stopped", time.perf_counter() - start)
        if self.diloco is not None:
            self.diloco.close()
        if finished and r.checkpoint.export_hf and not self.replica:  # every DiLoCo group ends with the same model
            final = export_final(self.parallel, self.config, self.out_dir / "final", manifest)
            if final is not None and r.data.source != "synthetic":  # evaluation needs the tokenizer beside the weights
                from ..eval.model import attach_tokenizer

                attach_tokenizer(final, self._data_dir())
        if self.rank == 0:
            write_json(self.out_dir / "run_manifest.json", manifest)
            self.log.close()
            plot_loss_curves({r.name: read_metrics(self.out_dir)}, self.out_dir / "loss_curves.png", title=r.name)
        return manifest
