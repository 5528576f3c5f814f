"""Chaos: streaming clients against the served stack while engine actors are killed.

    python -m benchmarks.bench_chaos [--quick] [--clients 8] [--kills 2] [--hangs 1]
        [--overlaps 1] [--seed 0]

The server is `make serve`'s (python -m deployments.serve, TP = 2, embedded models, a
subprocess with its own Ray head). `--clients` threads stream seeded requests back to
back, half greedy and half sampled; a seeded schedule kills the draft actor, the
follower rank (rank1) and rank 0, `--kills` times each, in a shuffled order, one kill
every `--gap` seconds, with ray.kill (SIGKILL of the actor's process); and `--hangs`
times each, the same actors hang: SIGSTOP of the actor's process, which stays alive to
Ray and answers nothing until the supervisor's probe (`recovery.probe_timeout_s`, 10 s
by default) declares it dead and the engine SIGKILLs it (README: an actor that hangs).
`--overlaps` times each, two compound faults: `draft+rank0`, the draft actor is killed
and, as soon as its replacement is launched (its name registered: it loads now), rank 0
too, so the gang restart overlaps the new draft actor's load; and `draft+hang-rank0`,
the same with rank 0 SIGSTOPped instead, which the probe notices only after the new
actor has loaded, so the gang restart overlaps the new actor's attach to the hung rank 0.
A poller asks grpc.health.v1 Check for the `cactus.v1.Cactus` service (does the replica
take requests; the server's "" also says NOT_SERVING while a draft actor is replaced)
every 100 ms. Reported:
  - requests total / OK / resumed / degraded / failed by status code
  - tokens lost and duplicated: every greedy stream token by token against its
    uninterrupted output (the verifier's greedy decoding, in this process); every
    sampled stream by count only, its streamed tokens against its final result's
    usage.completion_tokens (a resumed sampled stream has no reference to compare with)
  - per kill: time to SERVING again (rank kills) or until the new draft actor drafts
    again (draft kills), "not recovered" past 120 s, and whether the service's health
    left SERVING (measured for every fault: it must not for the draft)
  - the longest health Check
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

from benchmarks.load import ServerProcess, exit_on_sigterm
from client import CactusClient
from workers.processes import is_running

REPO = Path(__file__).resolve().parent.parent
PROMPTS = [
    "def parse(text):",
    "class Stack:",
    "import os\n\ndef walk(root):",
    "def fibonacci(n):",
    "def read_config(path):",
    "class Matrix:\n    def __init__(self, rows):",
    "def merge_sorted(a, b):",
    "def tokenize(line):",
]


def _actor(role: str):
    """The server's engine actor with this role (draft, rank0, rank1), looked up by
    name on the server's Ray cluster (this process is connected to it as a driver)."""
    import ray

    names = [
        e["name"]
        for e in ray.util.list_named_actors(all_namespaces=True)
        if e["namespace"] == "cactus" and e["name"].endswith(f"-{role}")
    ]
    if len(names) != 1:
        raise RuntimeError(f"expected one {role} actor, found {names}")
    return names[0], ray.get_actor(names[0], namespace="cactus")


def _draft_names() -> list[str]:
    """Names of the live draft actors (one loading counts: it is named at its launch)."""
    import ray

    return [
        e["name"]
        for e in ray.util.list_named_actors(all_namespaces=True)
        if e["namespace"] == "cactus" and e["name"].endswith("-draft")
    ]


def kill(role: str) -> None:
    import ray

    ray.kill(_actor(role)[1])


def stop_process(role: str) -> dict:
    """SIGSTOP the actor's process (a hang: alive to Ray, answering nothing); returns
    its identity (pid, start time), as the actor reports it."""
    import ray

    ident = ray.get(_actor(role)[1].status.remote(), timeout=10)["process"]
    os.kill(ident["pid"], signal.SIGSTOP)
    return ident


def draft_blocks() -> tuple[str, int]:
    """The current draft actor's name and how many blocks it has drafted."""
    import ray

    name, actor = _actor("draft")
    return name, ray.get(actor.status.remote(), timeout=10)["blocks_proposed"]


def _diff(want: list[int], got: list[int]) -> tuple[int, int]:
    """(lost, duplicated): tokens of `want` missing from `got`, and extra ones in it."""
    matcher = difflib.SequenceMatcher(a=want, b=got, autojunk=False)
    same = sum(block.size for block in matcher.get_matching_blocks())
    return len(want) - same, len(got) - same


class Chaos:
    def __init__(self, args) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.lock = threading.Lock()
        self.outcomes: Counter = Counter()
        self.lost = self.duplicated = 0
        self.greedy_checked = self.greedy_equal = 0
        self.resumed = self.degraded = 0
        self.health: list[tuple[float, str, float]] = []  # (at, status, seconds)
        self.kills: list[dict] = []
        self.stopped: list[dict] = []  # processes this script SIGSTOPped
        self.left_stopped: list[dict] = []
        self.stop = threading.Event()
        self.reference: dict[tuple[str, int], list[int]] = {}

    def greedy_reference(self, prompt: str) -> list[int]:
        """The uninterrupted greedy output (the verifier's argmax decoding)."""
        key = (prompt, self.args.max_tokens)
        if key not in self.reference:
            from cactus.params import GenerationRequest, SamplingParams, SpeculationParams

            self.reference[key] = list(
                self.engine.generate(
                    GenerationRequest(
                        prompt=prompt,
                        sampling=SamplingParams(max_tokens=self.args.max_tokens, temperature=0.0),
                        speculation=SpeculationParams(rule="none"),
                    )
                ).token_ids
            )
        return self.reference[key]

    def client(self, idx: int, address: str) -> None:
        client = CactusClient(address, timeout=600)
        n = 0
        while not self.stop.is_set():
            n += 1
            prompt = PROMPTS[(idx + n) % len(PROMPTS)]
            greedy = idx % 2 == 0
            kw = {"temperature": 0.0} if greedy else {"temperature": 0.8, "top_k": 40}
            chunks = []
            try:
                for chunk in client.stream(
                    prompt,
                    max_tokens=self.args.max_tokens,
                    seed=idx * 100_000 + n,
                    rule="cactus",
                    delta=1.0,
                    **kw,
                ):
                    chunks.append(chunk)
                code = "OK"
            except grpc.RpcError as err:
                code = err.code().name
            streamed = [t for c in chunks for t in c.token_ids]
            with self.lock:
                self.outcomes[code] += 1
                if code != "OK":
                    continue
                final = chunks[-1]
                self.resumed += final.stats.resumed > 0
                self.degraded += final.stats.degraded
                # The result's own count (usage) against what came over the stream.
                count = final.usage.completion_tokens
                lost, dup = max(0, count - len(streamed)), max(0, len(streamed) - count)
                if greedy:  # and token for token against the uninterrupted output
                    want = self.greedy_reference(prompt)
                    self.greedy_checked += 1
                    self.greedy_equal += streamed == want
                    if streamed != want:
                        lost, dup = _diff(want, streamed)
                self.lost += lost
                self.duplicated += dup

    def poll(self, address: str) -> None:
        checker = CactusClient(address, timeout=30)
        while not self.stop.is_set():
            start = time.monotonic()
            try:
                status = checker.health("cactus.v1.Cactus")
            except grpc.RpcError as err:
                status = err.code().name
            took = time.monotonic() - start
            with self.lock:
                self.health.append((start, status, took))
            time.sleep(0.1)

    def serving_since(self, since: float) -> float | None:
        with self.lock:
            down = [at for at, s, _ in self.health if at >= since and s != "SERVING"]
            if not down:
                return None
            back = [at for at, s, _ in self.health if at > max(down) and s == "SERVING"]
        return back[0] if back else None

    def _drafting_again(self, before: str, start: float, deadline: float) -> float | None:
        """Seconds from `start` until a draft actor other than `before` drafts."""
        while time.monotonic() < deadline:
            try:
                name, blocks = draft_blocks()
                if name != before and blocks > 0:
                    return round(time.monotonic() - start, 1)
            except Exception:
                pass
            time.sleep(0.5)
        return None

    def _serving_again(self, start: float, deadline: float) -> float | None:
        """Seconds from `start` until health is SERVING again after leaving it."""
        time.sleep(1.0)
        while time.monotonic() < deadline:
            back = self.serving_since(start)
            if back is not None:
                return round(back - start, 1)
            time.sleep(0.2)
        return None

    def run_kill(self, fault: str, ray_address: str) -> dict:
        """One fault: `role` (kill), `hang-role` (SIGSTOP), or `draft+rank0` /
        `draft+hang-rank0` (the draft actor killed, then rank 0 killed or stopped while
        the replacement loads)."""
        compound = fault.startswith("draft+")
        role = fault.removeprefix("hang-")
        before = draft_blocks() if role.startswith("draft") else None
        start = time.monotonic()
        record = {"role": fault, "at_s": round(start - self.t0, 1)}
        deadline = start + 120
        record["recovered_s"] = None  # unless it recovers within the deadline
        if fault.startswith("hang-"):
            self.stopped.append(stop_process(role))
        elif compound:
            kill("draft")
            while time.monotonic() < deadline:  # the replacement's launch
                names = [n for n in _draft_names() if n != before[0]]
                if names:
                    break
                time.sleep(0.05)
            record["rank0_after_s"] = round(time.monotonic() - start, 1)
            if fault == "draft+hang-rank0":
                self.stopped.append(stop_process("rank0"))
            else:
                kill("rank0")
        else:
            kill(role)
        if compound:  # both: serving again, and the new actor drafting
            serving = self._serving_again(start, deadline)
            drafting = self._drafting_again(before[0], start, deadline)
            record["serving_s"], record["drafting_s"] = serving, drafting
            if serving is not None and drafting is not None:
                record["recovered_s"] = max(serving, drafting)
        elif role == "draft":  # health must stay SERVING; wait for drafting to resume
            record["recovered_s"] = self._drafting_again(before[0], start, deadline)
        else:
            record["recovered_s"] = self._serving_again(start, deadline)
        # measured for every fault: a rank's restart takes the service out of SERVING,
        # a draft actor's replacement must not
        with self.lock:
            statuses = {s for at, s, _ in self.health if at >= start}
        if statuses:  # (no sample since the fault: not measured, printed "-")
            record["health_left_serving"] = statuses != {"SERVING"}
        if "hang-" in fault:
            record["stopped_process_ended"] = not is_running(self.stopped[-1])
        return record

    def run(self) -> dict:
        from cactus.environment import DEFAULT_DRAFT, DEFAULT_VERIFIER
        from workers.local import local_engine

        self.engine = local_engine(str(DEFAULT_VERIFIER), str(DEFAULT_DRAFT))
        for prompt in PROMPTS:
            self.greedy_reference(prompt)
        server = ServerProcess(
            {
                "tp_size": 2,
                "limits": {
                    "max_ongoing_requests": self.args.clients + 4,
                    "max_queued_requests": 4 * self.args.clients,
                },
            }
        )
        try:
            server.wait_ready()
            import ray

            ray.init(address=server.ray_address(), log_to_driver=False, configure_logging=False)
            ray_address = server.ray_address()
            schedule = ["draft", "rank1", "rank0"] * self.args.kills
            schedule += ["hang-draft", "hang-rank1", "hang-rank0"] * self.args.hangs
            schedule += ["draft+rank0", "draft+hang-rank0"] * self.args.overlaps
            self.rng.shuffle(schedule)
            self.t0 = time.monotonic()
            threads = [
                threading.Thread(target=self.client, args=(i, server.address), daemon=True)
                for i in range(self.args.clients)
            ]
            threads.append(threading.Thread(target=self.poll, args=(server.address,), daemon=True))
            for t in threads:
                t.start()
            time.sleep(self.args.gap)
            for role in schedule:
                self.kills.append(self.run_kill(role, ray_address))
                time.sleep(self.args.gap)
            self.stop.set()
            for t in threads:
                t.join(timeout=600)
            duration = time.monotonic() - self.t0
        finally:
            import ray

            ray.shutdown()
            server.stop()
            # a stopped process the engine left behind (a bug) would never exit
            self.left_stopped = [i for i in self.stopped if is_running(i)]
            for ident in self.left_stopped:
                os.kill(ident["pid"], signal.SIGKILL)
        return self.report(duration)

    def report(self, duration: float) -> dict:
        checks = [took for _, _, took in self.health]
        total = sum(self.outcomes.values())
        return {
            "duration_s": round(duration, 1),
            "clients": self.args.clients,
            "requests": total,
            "ok": self.outcomes.get("OK", 0),
            "failed": {k: v for k, v in self.outcomes.items() if k != "OK"},
            "resumed": self.resumed,
            "degraded": self.degraded,
            "greedy_checked": self.greedy_checked,
            "greedy_equal": self.greedy_equal,
            "tokens_lost": self.lost,
            "tokens_duplicated": self.duplicated,
            "kills": self.kills,
            "stopped_processes_left": len(self.left_stopped),
            "longest_check_s": round(max(checks), 3) if checks else None,
            "median_check_s": round(statistics.median(checks), 4) if checks else None,
            "checks": len(checks),
        }


def markdown(r: dict) -> str:
    lines = [
        f"# chaos: {r['clients']} streaming clients, {r['duration_s']} s, "
        f"{len(r['kills'])} faults (seeded schedule)",
        "| requests | OK | resumed | degraded | failed | greedy equal | tokens lost "
        "| tokens duplicated | longest Check |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {r['requests']} | {r['ok']} | {r['resumed']} | {r['degraded']} | "
        f"{sum(r['failed'].values())} {r['failed'] or ''} | "
        f"{r['greedy_equal']}/{r['greedy_checked']} | {r['tokens_lost']} | "
        f"{r['tokens_duplicated']} | {r['longest_check_s']} s |",
        "",
        "| fault | at (s) | recovered after (s) | health left SERVING | stopped process ended |",
        "|---|---|---|---|---|",
    ]
    for k in r["kills"]:
        left = k.get("health_left_serving", "-")  # "-": not measured
        ended = k.get("stopped_process_ended", "")
        back = "not recovered" if k["recovered_s"] is None else k["recovered_s"]
        if "serving_s" in k:  # the compound fault: both parts of its recovery
            how = "stopped" if "hang-" in k["role"] else "killed"
            back = (
                f"{back} (rank 0 {how} at {k['rank0_after_s']}; serving at "
                f"{k['serving_s']}, drafting at {k['drafting_s']})"
            )
        lines.append(f"| {k['role']} | {k['at_s']} | {back} | {left} | {ended} |")
    lines.append(
        "\n# recovered after: draft = until the new draft actor drafts again; "
        "rank = until health is SERVING again; draft+X = both. Tokens lost / "
        "duplicated: greedy streams token by token against the uninterrupted output, "
        "sampled streams by count (the streamed tokens against the result's "
        "completion_tokens). hang-X: X's process SIGSTOPped (noticed after "
        "recovery.probe_timeout_s); stopped processes left at the end: "
        f"{r['stopped_processes_left']}"
    )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 kill of each, 4 clients, 8 s apart")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--kills", type=int, default=2, help="kills of each actor")
    parser.add_argument("--hangs", type=int, default=1, help="SIGSTOPs of each actor")
    parser.add_argument(
        "--overlaps",
        type=int,
        default=1,
        help="draft kills with rank 0 killed, and stopped, during the replacement",
    )
    parser.add_argument("--gap", type=float, default=20.0, help="seconds between kills")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--md", type=Path, default=None, help="also write the tables here")
    args = parser.parse_args(argv)
    if args.quick:
        args.clients, args.kills, args.hangs, args.overlaps, args.gap = 4, 1, 0, 0, 8.0

    from cactus import environment

    environment.apply()  # as the server has it (auth off, loopback)
    exit_on_sigterm()
    import torch

    torch.set_num_threads(1)
    result = Chaos(args).run()
    text = markdown(result)
    print(text, flush=True)
    if args.md:
        import platform
        import shlex

        command = "python -m benchmarks.bench_chaos " + shlex.join(argv or sys.argv[1:])
        args.md.write_text(
            f"Generated by `{command}` on {time.strftime('%Y-%m-%d')} "
            f"({platform.machine()}, {os.cpu_count()} CPUs); do not edit by hand.\n\n" + text + "\n"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
