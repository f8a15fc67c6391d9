"""ContinuousBatchEngine: one thread runs schedule → forward → sample → update; callers submit and
abort from any thread and receive RequestEvents through their on_event callback."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from sparkinfer_cli.engine.config import (
    EngineConfig,
    EngineStoppedError,
    QueueFullError,
    RequestTooLargeError,
)
from sparkinfer_cli.engine.constraint import GrammarConstraint, check_grammar
from sparkinfer_cli.engine.draft_budget import DraftBudget
from sparkinfer_cli.engine.draft_model import DraftModel
from sparkinfer_cli.engine.greedy_batch import GreedyBatch, default_num_threads
from sparkinfer_cli.engine.kv_cache import CacheOps, KVCacheManager, PrefixCacheStats
from sparkinfer_cli.engine.model_runner import ModelRunner
from sparkinfer_cli.engine.mtp_drafts import MtpDrafter
from sparkinfer_cli.engine.policy import create_policy
from sparkinfer_cli.engine.request import OutputStream, Request, RequestEvent
from sparkinfer_cli.engine.sampler import GRAMMAR_DEAD_END, Sampler, UnsatisfiableSampling
from sparkinfer_cli.engine.sampling_params import SamplingParams
from sparkinfer_cli.engine.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from sparkinfer_cli.engine.speculative import (
    Drafter,
    DraftLength,
    NgramDrafter,
    SpeculationStats,
    accepted_drafts,
    sampled_drafts,
)
from sparkinfer_cli.engine.step_timings import StepTimings, StepTrace
from sparkinfer_cli.engine.stop import StopStringMatcher
from sparkinfer_cli.model.backend import ModelBackend
from sparkinfer_cli.model.batch import ARGMAX, SamplingRows
from sparkinfer_cli.tokenizer.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from sparkinfer_cli.tokenizer.tokenizer import Tokenizer

__all__ = ["ContinuousBatchEngine", "EngineConfig", "EngineStats", "EngineStoppedError",
           "QueueFullError", "RequestEvent", "RequestTooLargeError"]

log = logging.getLogger(__name__)
IDLE_POLL_S = 0.05  # upper bound on how long the loop sleeps while some request cannot run yet


@dataclass
class EngineStats:
    active_requests: int
    queued_requests: int
    free_kv_blocks: int
    total_kv_blocks: int
    max_queue_depth: int
    accepting_requests: bool
    step_timings: StepTimings = field(default_factory=StepTimings)  # cumulative, per step kind
    prefix_cache: PrefixCacheStats | None = None
    state_snapshot_bytes: int = 0  # memory of one recurrent-state snapshot (hybrid models)
    block_size: int = 0  # tokens per KV block (0: not reported, so KV token figures are unknown)
    max_num_seqs: int = 0  # sequences a step can run at once (0: not reported)
    speculation: SpeculationStats | None = None  # None: this engine drafts nothing

    @property
    def kv_cache_usage(self) -> float:
        """The fraction of KV blocks in use (1 = full); cached unreferenced blocks count as free."""
        return 1 - self.free_kv_blocks / max(self.total_kv_blocks, 1)


class ContinuousBatchEngine:
    def __init__(self, model: ModelBackend, tokenizer: Tokenizer, config: EngineConfig,
                 draft_model: ModelBackend | None = None, use_mtp: bool = False):
        """Drafts (config.spec_tokens of them a step at most) come from draft_model, a smaller
        model of the same vocabulary, decoding greedily; or with use_mtp from the model's MTP
        head (model.mtp); else from n-gram lookup."""
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.n_vocab = model.config.n_vocab
        if any(t >= self.n_vocab for t in config.prefix_token_ids):
            raise ValueError(f"prefix token ids must be in [0, {self.n_vocab})")
        # drafts are checked by the pass's own rows: models that score them (a hybrid model's
        # state is copied before such a pass and restored after a rejection: Scheduler)
        self._can_speculate = bool(config.spec_tokens and model.scores_drafts)
        self.kv = KVCacheManager.from_config(config, model.config.is_hybrid,
                                             draft_slots=self._can_speculate,
                                             snapshots_draft_states=model.snapshots_draft_states)
        cache = model.create_cache(config.num_blocks, config.block_size, self.kv.num_state_slots)
        self._state_bytes = model.config.recurrent_state_bytes() if model.config.is_hybrid else 0
        pass_tokens = min((n for n in (model.max_pass_tokens, model.invariant_pass_tokens) if n),
                          default=0)
        self.drafter = _drafter(model, config, draft_model, use_mtp)
        self._keeps_hidden = use_mtp  # the MTP head reads the model's hidden states
        self.budget = DraftBudget() if self._can_speculate and config.draft_budget else None
        self.scheduler = Scheduler(config, self.kv, create_policy(config), pass_tokens,
                                   model.max_draft_pass_tokens, self.drafter, self.budget)
        self.runner = ModelRunner(model, cache, self.drafter.caches)
        self.speculation = SpeculationStats()  # written by the engine thread only
        if config.spec_tokens and not self._can_speculate:
            log.warning("speculative decoding is off: this model cannot check drafts")
        self.timings = StepTimings()
        self._trace = StepTrace(config.step_trace) if config.step_trace else None
        self._last_passes = 1  # decode passes the last step queued
        self.greedy = GreedyBatch(config.sampling_threads or default_num_threads())
        self._lock = threading.Condition()
        self._inbox: list[Request] = []
        self._aborts: list[str] = []
        self._cache_flushes: list[Future[int]] = []
        self._is_aborting_waiting = False
        self._live_ids: set[str] = set()  # submitted and not finished (the queue depth)
        self._accepting, self._stopping = True, False
        self._arrivals = itertools.count()
        self._thread: threading.Thread | None = None
        self._warmed = threading.Event()
        self._warm_error: BaseException | None = None

    @property
    def keeps_state_snapshots(self) -> bool:
        """The prefix cache snapshots recurrent state (a hybrid model with the cache on), so
        SamplingParams.snapshot_positions are worth computing."""
        return self.kv.is_hybrid and self.config.prefix_cache

    @property
    def max_context(self) -> int:
        """The longest prompt + output one request may have."""
        return min(self.kv.max_request_tokens, self.model.config.context_length)

    # ---- caller side (any thread) ----------------------------------------------------------------
    def start(self) -> None:
        """Starts the engine thread; returns once the decode graphs are captured (models that
        have them) and the shared prefix is warm."""
        if self._thread is not None:
            raise RuntimeError("engine already started")
        self._thread = threading.Thread(target=self._loop, name="sparkinfer-engine", daemon=True)
        self._thread.start()
        self._warmed.wait()
        if self._warm_error is not None:
            raise RuntimeError(f"engine warm-up failed: {self._warm_error}")

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               on_event: Callable[[RequestEvent], None], *, priority: int = 0,
               request_id: str | None = None) -> str:
        """Queues a request; returns its id. max_tokens is capped at max_output_tokens; a higher
        priority runs sooner under the priority policy. Raises ValueError (bad prompt),
        RequestTooLargeError, EngineStoppedError or QueueFullError; nothing is allocated then."""
        params = dataclasses.replace(params, max_tokens=min(params.max_tokens,
                                                            self.config.max_output_tokens))
        self._check_prompt(prompt_ids, params)
        with self._lock:
            if not self._accepting:
                raise EngineStoppedError("the engine is shutting down and accepts no new requests")
            depth = self.config.max_queue_depth
            if depth and len(self._live_ids) >= depth:
                raise QueueFullError(f"queue full: {len(self._live_ids)} requests in flight or "
                                     f"queued (max_queue_depth={depth})")
            request = self._create_request(prompt_ids, params, on_event, priority, request_id)
            self._live_ids.add(request.request_id)
            self._inbox.append(request)
            self._lock.notify()
        return request.request_id

    def check_grammar(self, grammar: str) -> str:
        """The grammar, once it compiles for this vocabulary (what SamplingParams.grammar may
        hold); ValueError naming the problem when it does not."""
        return check_grammar(grammar, self.tokenizer, self.n_vocab)

    def abort(self, request_id: str) -> None:
        """Ends the request (final event "abort") and frees its KV within one engine step."""
        with self._lock:
            if request_id in self._live_ids:
                self._aborts.append(request_id)
                self._lock.notify()

    def abort_waiting(self) -> None:
        """Ends every request not started yet (queued: no KV, no token; final event "abort")
        within one engine step, so a draining server can send them elsewhere; the running ones
        go on."""
        with self._lock:
            self._is_aborting_waiting = True
            self._lock.notify()

    def stats(self) -> EngineStats:
        with self._lock:
            num_live, accepting = len(self._live_ids), self._accepting
        num_active = len(self.scheduler.running)
        return EngineStats(active_requests=num_active,
                           queued_requests=max(num_live - num_active, 0),
                           free_kv_blocks=self.kv.num_free_blocks,
                           total_kv_blocks=self.config.num_blocks,
                           max_queue_depth=self.config.max_queue_depth,
                           accepting_requests=accepting, step_timings=self.timings.copy(),
                           prefix_cache=self.kv.prefix_stats(),
                           state_snapshot_bytes=self._state_bytes,
                           block_size=self.config.block_size,
                           max_num_seqs=self.config.max_num_seqs,
                           speculation=dataclasses.replace(self.speculation)
                           if self._can_speculate else None)

    def flush_prefix_cache(self) -> Future[int]:
        """Drops the prefix cache's content between two steps of the engine thread (which alone
        touches it); the future gets the number of KV blocks freed. Only what no running request
        uses goes, so requests in flight are unaffected; the configured shared prefix stays."""
        flushed: Future[int] = Future()
        with self._lock:
            if self._stopping:
                raise EngineStoppedError("the engine is shutting down")
            self._cache_flushes.append(flushed)
            self._lock.notify()
        return flushed

    def shutdown(self, wait: bool = True) -> None:
        """Stops accepting requests; the thread finishes those in flight, then exits."""
        with self._lock:
            self._accepting, self._stopping = False, True
            self._lock.notify()
        thread = self._thread
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()

    def _check_prompt(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("the prompt must contain at least one token")
        if any(not 0 <= t < self.n_vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.n_vocab})")
        if len(prompt_ids) + params.max_tokens > self.max_context:
            raise RequestTooLargeError(
                f"this request needs {len(prompt_ids)} prompt tokens + max_tokens "
                f"{params.max_tokens} = {len(prompt_ids) + params.max_tokens} tokens, but the "
                f"context limit is {self.max_context} tokens")

    def _create_request(self, prompt_ids: list[int], params: SamplingParams,
                        on_event: Callable[[RequestEvent], None], priority: int,
                        request_id: str | None) -> Request:
        arrival = next(self._arrivals)
        request_id = request_id or f"req-{arrival}"
        if request_id in self._live_ids:
            raise ValueError(f"request id {request_id!r} is already in flight")
        eog_ids = () if params.ignore_eos else self.tokenizer.eog_ids
        stop_ids = frozenset(int(t) for t in (*params.stop_token_ids, *eog_ids) if t is not None)
        output = OutputStream(IncrementalDetokenizer(self.tokenizer, skip_special=True),
                              StopStringMatcher(params.stop), stop_ids)
        constraint = GrammarConstraint(params.grammar, self.tokenizer, self.n_vocab,
                                       params.reasoning_tokens, params.reasoning_open) \
            if params.grammar else None
        sampler = Sampler(params, self.n_vocab, stop_ids, constraint)
        request = Request(request_id, list(prompt_ids), params, on_event, priority, arrival, output,
                          sampler)
        if self._can_speculate and (sampler.is_plain_greedy or
                                    sampler.checks_drafts_by_sampling):
            request.drafting = DraftLength(self.config.spec_tokens)
        if self.config.request_timeout_s:
            request.deadline = request.submitted_at + self.config.request_timeout_s
        return request

    # ---- engine thread ---------------------------------------------------------------------------
    def step(self) -> SchedulerOutput:
        """One iteration: schedule, run the model, sample, update, report. Returns what ran."""
        output = self.scheduler.schedule()
        self._last_passes = 1
        if output.needs_all_logits:
            self._run_prompt_logits(output)
            return output
        on_device, rows = self._device_picks(output)
        if self._keeps_hidden and rows is not None:  # draws come with no hidden states
            on_device, rows = False, None
        # queued passes return no hidden states, which an MTP head reads
        n_steps = self._num_decode_steps(output) if on_device and not self._keeps_hidden else 1
        if n_steps > 1:
            self._last_passes = n_steps
            self._run_decode_steps(self.scheduler.extend_decodes(output, n_steps), n_steps, rows)
            return output
        hidden: dict[str, np.ndarray] = {}
        try:
            if self._keeps_hidden:
                results, hidden = self.runner.run_hidden(output, picks=on_device)
            elif on_device:
                results = self.runner.run_device_picks(output, rows)
            else:
                results = self.runner.run(output)
        except Exception as exc:  # a failed forward pass ends the requests it carried
            self._fail([self.scheduler.requests[s.request_id] for s in output.sequences], exc)
            return output
        self.scheduler.update_from_output(output)
        checked = [(s, results.pop(s.request_id)) for s in output.sequences if s.num_drafts]
        requests = [self.scheduler.requests[request_id] for request_id in results]
        outputs = list(results.values())  # logits, or the tokens the model picked
        tokens = [int(t) for t in outputs] if on_device else \
            self._greedy_tokens(requests, outputs)
        for request, logits, token in zip(requests, outputs, tokens):
            self._append_sample(request, None if on_device else logits, token)
        for seq, draft_rows in checked:
            self._append_checked(self.scheduler.requests[seq.request_id], seq, draft_rows)
        self._keep_hidden(output, hidden)
        return output

    def _keep_hidden(self, output: SchedulerOutput, hidden: dict[str, np.ndarray]) -> None:
        """Each drafting request's hidden states of the positions whose tokens stand (a checked
        draft's row counts only up to the first draft not kept), for its MTP head."""
        for seq in output.sequences:
            request = self.scheduler.requests.get(seq.request_id)
            if request is None or request.drafting is None or seq.request_id not in hidden:
                continue
            start, tokens = seq.start_position, request.token_ids
            stand = 0
            while stand < len(seq.token_ids) and start + stand < len(tokens) and \
                    seq.token_ids[stand] == tokens[start + stand]:
                stand += 1
            request.drafting.hidden.put(start, hidden[seq.request_id][:stand])

    def _append_checked(self, request: Request, seq: ScheduledSequence,
                        rows: np.ndarray) -> None:
        """rows (1 + drafts, n_vocab): the logits after the fed token and after each draft, or
        (1 + drafts,) their argmax ids where the model picked them (a plain greedy request). A
        greedy request keeps the drafts its argmaxes confirm, a sampled one those speculative
        sampling keeps (sampled_drafts); the kept drafts and the token after them are appended,
        one by one, as decoding them singly would have; a draft's KV counts once the token after
        it is kept."""
        drafts = seq.token_ids[-seq.num_drafts:]
        assert request.sampler is not None
        picked = rows.ndim == 1
        if request.sampler.is_plain_greedy:
            # None where a row's maximum is not finite
            greedy = [int(t) for t in rows] if picked else self.greedy.tokens(list(rows))
            kept = accepted_drafts(drafts, greedy)
            last = greedy[kept]
        else:
            try:
                kept, last = sampled_drafts(request.sampler, rows, drafts)
            except UnsatisfiableSampling as exc:
                self._finish(request, "rejected", str(exc))
                return
        self.speculation.record(len(drafts), kept)
        if self.budget is not None:
            self.budget.checked(len(drafts), kept)
        if request.drafting is not None:
            request.drafting.checked(len(drafts), kept)
        computed = self.scheduler.drafts_checked(request, seq, kept)
        for i in range(kept + 1):
            if request.is_finished:
                return
            if i and computed:
                self.scheduler.decoded(request)
            # NOTE: no token (a non-finite row, or every draft kept by sampling) leaves the choice
            # to the sampler, as decoding does. A hybrid model's state ran all the kept drafts:
            # it is current only once they are all appended (or after a restore)
            current = i == kept or not (computed and self.kv.is_hybrid)
            self._append_sample(request, None if picked else rows[i],
                                drafts[i] if i < kept else last, current)

    def _run_prompt_logits(self, output: SchedulerOutput) -> None:
        """A step that carries one prompt piece alone, whose tokens' logprobs are asked for; a
        request scoring its prompt only (max_tokens 0) ends with it."""
        (seq,) = output.sequences
        request = self.scheduler.requests[seq.request_id]
        try:
            logits = self.runner.run_all_logits(output)  # (piece, n_vocab)
        except Exception as exc:  # a failed forward pass ends its request
            self._fail([request], exc)
            return
        self.scheduler.update_from_output(output)
        request.add_prompt_logprobs(logits, seq.start_position)
        if seq.needs_logits and request.params.max_tokens == 0:
            self._finish(request, "length")
        elif seq.needs_logits:
            self._append_sample(request, logits[-1], None)

    def _num_decode_steps(self, output: SchedulerOutput) -> int:
        """Decode passes to queue at once: up to config.decode_steps (and the model's limit) when
        every sequence decodes and samples, no waiting request could join now (every sequence
        slot is taken) and no submission or abort is pending (they would wait for the passes),
        never past a request's max_tokens."""
        limit = min(self.config.decode_steps, self.runner.max_decode_steps)
        could_join = self.scheduler.waiting and \
            len(self.scheduler.running) < self.config.max_num_seqs
        if limit <= 1 or could_join or not output.is_decode_only or \
                not all(s.needs_logits for s in output.sequences):
            return 1
        with self._lock:
            if self._inbox or self._aborts or self._is_aborting_waiting:
                return 1
        requests = [self.scheduler.requests[s.request_id] for s in output.sequences]
        # a request pausing its drafts drafts again once the pause's tokens are decoded
        pauses = [r.drafting.paused_tokens(r.num_tokens) for r in requests
                  if r.drafting is not None]
        return min([limit] + [r.params.max_tokens - r.num_output_tokens for r in requests] +
                   [n for n in pauses if n])

    def _run_decode_steps(self, output: SchedulerOutput, n_steps: int,
                          rows: SamplingRows | None) -> None:
        """n_steps passes of a decode-only step, greedy (rows None) or drawn on the device (rows:
        the first pass's draws); each pass's tokens are appended (and streamed) as soon as it
        finishes. A request that ends meanwhile ignores later passes."""
        requests = [self.scheduler.requests[s.request_id] for s in output.sequences]
        draws = None if rows is None else \
            (lambda step: rows if step == 0 else self._queued_draws(requests))
        try:
            for n, ids in enumerate(self.runner.run_decode_steps(output, n_steps, draws), 1):
                for request, token in zip(requests, ids):
                    if not request.is_finished:
                        self.scheduler.decoded(request)
                        self._append_sample(request, None, int(token), n == n_steps)
        except Exception as exc:  # a failed pass ends the requests still running
            self._fail(requests, exc)

    def _queued_draws(self, requests: list[Request]) -> SamplingRows:
        """The draws of a queued decode pass after the first, made once the pass before it has
        been appended (a grammar's mask follows its token). A request that ended meanwhile takes
        the argmax (its token is ignored); one whose grammar allows no token ends here."""
        draws, masks = [], []
        for request in requests:
            draw, mask = ARGMAX, None
            if not request.is_finished:
                assert request.sampler is not None
                mask = request.sampler.device_mask()
                if mask is not None and not mask.any():
                    self._finish(request, "rejected", GRAMMAR_DEAD_END, state_is_current=False)
                    mask = None
                else:
                    draw = request.sampler.device_draw()
            draws.append(draw)
            masks.append(mask)
        return SamplingRows.of(draws, masks)

    def _device_picks(self, output: SchedulerOutput) -> tuple[bool, SamplingRows | None]:
        """(whether the model picks every sampling sequence's token on its device, their
        draws (Sampler.device_draw), or None when all are plain greedy: the argmax)."""
        if not self.runner.can_pick_greedy:
            return False, None
        wanted = [self.scheduler.requests[s.request_id].sampler for s in output.sequences
                  if s.needs_logits]
        samplers = [x for x in wanted if x is not None]
        if not samplers or len(samplers) < len(wanted):
            return False, None
        if all(x.is_plain_greedy for x in samplers):
            return True, None
        if any(s.num_drafts for s in output.sequences):  # drawn per sequence, not per draft row
            return False, None
        limit = self.runner.max_sample_top_k
        if not all(x.can_sample_on_device(limit) for x in samplers):
            return False, None
        masks = [x.device_mask() for x in samplers]
        if any(m is not None and not m.any() for m in masks):  # a grammar with no way on: the
            return False, None  # host sampler ends the request with its error
        return True, SamplingRows.of([x.device_draw() for x in samplers], masks)

    def _greedy_tokens(self, requests: list[Request], rows: list[np.ndarray]) -> list[int | None]:
        """The plain greedy rows' tokens, sampled together; None for the other rows."""
        greedy = [i for i, (request, row) in enumerate(zip(requests, rows))
                  if request.sampler is not None and request.sampler.is_plain_greedy and
                  row.dtype == np.float32]
        tokens: list[int | None] = [None] * len(rows)
        for i, token in zip(greedy, self.greedy.tokens([rows[i] for i in greedy])):
            tokens[i] = token
        return tokens

    def _append_sample(self, request: Request, logits: np.ndarray | None,
                       token: int | None, state_is_current: bool = True) -> None:
        """token: the row's argmax when GreedyBatch or the model already picked it;
        state_is_current: no queued pass runs past this one (Scheduler.finish)."""
        try:
            assert request.sampler is not None
            if token is not None:
                result = request.sampler.take(token)
            else:
                assert logits is not None  # a row the model did not pick has its logits
                result = request.sampler.sample(logits, request.prompt_ids, request.output_ids)
            reason = request.append_sample(result)
        except UnsatisfiableSampling as exc:  # the request's settings, not a fault: no traceback
            self._finish(request, "rejected", str(exc))
            return
        except Exception as exc:
            log.exception("sampling failed for %s", request.request_id)
            self._finish(request, "error", f"sampling failed: {exc}")
            return
        if reason is not None:
            self._finish(request, reason, state_is_current=state_is_current)
        else:
            self._emit(request)

    def _fail(self, requests: list[Request], exc: Exception) -> None:
        """A forward pass failed: end those of its requests still running."""
        log.exception("model forward failed")
        for request in requests:
            if not request.is_finished:
                self._finish(request, "error", f"model forward failed: {exc}",
                             state_is_current=False)

    def _finish(self, request: Request, reason: str, error: str | None = None,
                state_is_current: bool = True) -> None:
        self.scheduler.finish(request, reason, error, state_is_current)
        with self._lock:
            self._live_ids.discard(request.request_id)
            self._lock.notify_all()
        self._emit(request)

    def _emit(self, request: Request) -> None:
        try:
            request.on_event(request.take_event())
        except Exception:  # NOTE: a broken consumer must not stop the engine; drop its request
            log.exception("on_event callback failed for %s; aborting it", request.request_id)
            if not request.is_finished:
                self._finish(request, "abort", "on_event callback failed")

    def _loop(self) -> None:
        try:
            self._prepare_model()
        except Exception as exc:
            log.exception("engine warm-up failed")
            self._warm_error = exc
            return
        finally:
            self._warmed.set()
        while True:
            try:
                commands = self._wait_for_commands()
                if commands is None:
                    self.greedy.shutdown()
                    if self._trace is not None:
                        self._trace.close()
                    return
                started = time.perf_counter()  # NOTE: busy time only; idle waits are excluded
                started_cpu = time.thread_time()
                self._apply_commands(*commands)
                if self.scheduler.has_unfinished:
                    self._timed_step(started, started_cpu)
            except Exception as exc:  # an engine bug: end what is in flight, keep serving
                log.exception("engine step failed")
                for request in list(self.scheduler.requests.values()):
                    self._finish(request, "error", f"engine failure: {exc}")

    def _timed_step(self, started: float, started_cpu: float) -> None:
        self.runner.last_forward_s = 0.0
        output = self.step()
        if output.is_empty:
            with self._lock:  # NOTE: nothing can run until a request ends or is aborted
                self._lock.wait(IDLE_POLL_S)
        elif output.sequences:
            step_s = time.perf_counter() - started
            self.timings.add("decode" if output.is_decode_only else "mixed", step_s,
                             self.runner.last_forward_s)
            if self.budget is not None and output.is_decoding and self.runner.last_forward_s:
                # NOTE: queued decode passes are measured per pass (what a drafting step forgoes)
                self.budget.cost.observe(output.num_tokens,
                                         self.runner.last_forward_s / self._last_passes)
            if self._trace is not None:
                self._trace.write([len(s.token_ids) - s.num_drafts for s in output.sequences],
                                  self._last_passes, step_s, self.runner.last_forward_s,
                                  time.thread_time() - started_cpu)

    def _wait_for_commands(self) -> tuple[list[Request], list[str], list[Future[int]],
                                          bool] | None:
        """Sleeps while idle, then takes the submissions, aborts, cache flushes and whether to
        abort the waiting requests. None: time to exit."""
        with self._lock:
            while not (self._inbox or self._aborts or self._cache_flushes or
                       self._is_aborting_waiting or self.scheduler.has_unfinished):
                if self._stopping:
                    return None
                self._lock.wait()
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            flushes, self._cache_flushes = self._cache_flushes, []
            abort_waiting, self._is_aborting_waiting = self._is_aborting_waiting, False
        return inbox, aborts, flushes, abort_waiting

    def _apply_commands(self, inbox: list[Request], aborts: list[str],
                        flushes: list[Future[int]], abort_waiting: bool) -> None:
        for request in inbox:
            self.scheduler.add(request)
        for request_id in aborts:
            if request_id in self.scheduler.requests:
                self._finish(self.scheduler.requests[request_id], "abort")
        if abort_waiting:
            for request in list(self.scheduler.waiting):
                self._finish(request, "abort", "aborted before it started")
        for flushed in flushes:
            flushed.set_result(self.kv.prefix_cache.clear())
        if self.config.request_timeout_s:
            self._expire_deadlines()

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        for request in list(self.scheduler.requests.values()):
            if request.deadline is not None and now >= request.deadline:
                self._finish(request, "timeout", "the request exceeded its time limit")

    def _prepare_model(self) -> None:
        """Compiles and captures every pass the scheduler can form now, not mid-run (models with
        graphs), then warms the shared prefix."""
        self.model.prepare(self.runner.cache, self.config.max_num_seqs,
                           self.scheduler.max_pass_tokens)
        if self._can_speculate:
            self.drafter.prepare(self.config.max_num_seqs, self.scheduler.max_pass_tokens)
        self._warm_prefix()

    def _warm_prefix(self) -> None:
        prefix = self.kv.prefix
        if prefix is None:
            return
        self.runner.apply_cache_ops(CacheOps(state_resets=[prefix.state_slot]
                                             if self.kv.is_hybrid else []))
        limits = (0 if self.config.prefill_batched else self.config.prefill_chunk_tokens,
                  self.scheduler.max_step_tokens)
        chunk = min((n for n in limits if n), default=0)
        self.runner.prefill(self.kv.prefix_token_ids, prefix.block_ids, prefix.state_slot, chunk)
        self.kv.pin_prefix()


def _drafter(model: ModelBackend, config: EngineConfig, draft_model: ModelBackend | None,
             use_mtp: bool) -> Drafter:
    """Where the engine's drafts come from (ContinuousBatchEngine's arguments)."""
    if draft_model is not None and draft_model.config.n_vocab != model.config.n_vocab:
        raise ValueError(f"the draft model's vocabulary ({draft_model.config.n_vocab} "
                         f"tokens) is not the model's ({model.config.n_vocab})")
    if use_mtp:
        if model.mtp is None:
            raise ValueError("this model has no MTP head loaded (nextn_predict_layers)")
        return MtpDrafter(model.mtp, config.num_blocks, config.block_size)
    if draft_model is not None:
        return DraftModel(draft_model, config.num_blocks, config.block_size)
    return NgramDrafter()


def warm_up(engine: ContinuousBatchEngine, timeout_s: float = 600.0) -> bool:
    """One throwaway greedy request long enough to take the prefill path and then decode, so JIT
    compilation (or loading the kernel cache) is paid here, not by the first user or timing.
    Returns False if it did not finish in time."""
    finished = threading.Event()
    prompt = [i % engine.n_vocab for i in range(16)]

    def on_event(event: RequestEvent) -> None:
        if event.finish_reason is not None:
            finished.set()

    engine.submit(prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), on_event)
    return finished.wait(timeout_s)
