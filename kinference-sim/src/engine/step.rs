//! A step of the engine core: [`EngineCore::schedule`] (vLLM's
//! `Scheduler.schedule()`: pending aborts, running requests and recompute
//! preemption, admission of waiting requests, the batch's LoRA adapters and
//! the step's duration) and [`EngineCore::finish_step`]
//! (`update_from_output()`: sampling, TTFT and ITL, finishing requests).

use super::{EngineCore, FinishReason, Finished, ReqId, Scheduled, StepOut};

impl EngineCore {
    /// Plans the next step at `now`; `None` when there is nothing to run.
    pub fn schedule(&mut self, now: f64) -> Option<Scheduled> {
        for id in std::mem::take(&mut self.aborts) {
            if self.reqs.contains_key(&id) {
                self.finish(id, FinishReason::Abort, now);
            }
        }
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut entries = Vec::new();
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let want = {
                let r = &self.reqs[&id];
                (r.tokens.len() - r.num_computed).min(budget)
            };
            let mut scheduled = true;
            while !self.allocate(id, want, &[]) {
                let Some(victim) = self.running.pop() else {
                    scheduled = false;
                    break;
                };
                self.preempt(victim);
                preempted = true;
                if victim == id {
                    scheduled = false;
                    break;
                }
            }
            if !scheduled {
                break;
            }
            entries.push((id, want));
            budget -= want;
            i += 1;
        }
        // The distinct adapters of the batch so far (vLLM's
        // `scheduled_loras`), in batch order.
        let mut batch_loras: Vec<u32> = Vec::new();
        for (id, _) in &entries {
            if let Some(l) = self.reqs[id].lora
                && !batch_loras.contains(&l)
            {
                batch_loras.push(l);
            }
        }
        let (mut admitted_prompt, mut admitted_hits) = (0usize, 0usize);
        if !preempted {
            // Requests skipped for their adapter keep their place.
            let mut at = 0;
            while budget > 0 && self.running.len() < self.cfg.max_num_seqs {
                let Some(&id) = self.waiting.get(at) else {
                    break;
                };
                let lora = self.reqs[&id].lora;
                if let Some(l) = lora
                    && !batch_loras.contains(&l)
                    && batch_loras.len() >= self.loras.limit
                {
                    at += 1;
                    continue;
                }
                let (hits, hit_tokens) = self.lookup_prefix(id);
                self.rereport_hits(id, hits.len());
                let want = (self.reqs[&id].tokens.len() - hit_tokens).min(budget);
                self.reqs
                    .get_mut(&id)
                    .expect("waiting request exists")
                    .num_computed = hit_tokens;
                if !self.allocate(id, want, &hits) {
                    self.reqs
                        .get_mut(&id)
                        .expect("waiting request exists")
                        .num_computed = 0;
                    break;
                }
                self.waiting.remove(at);
                self.running.push(id);
                if let Some(l) = lora
                    && !batch_loras.contains(&l)
                {
                    batch_loras.push(l);
                }
                let r = self.reqs.get_mut(&id).expect("admitted request exists");
                if r.cached_tokens.is_none() {
                    r.cached_tokens = Some(hit_tokens);
                    r.scheduled = Some(now);
                    self.stats.queue.observe(now - r.arrival);
                }
                self.stats.prefix_cache_queries += r.tokens.len() as u64;
                self.stats.prefix_cache_hits += hit_tokens as u64;
                admitted_prompt += r.tokens.len();
                admitted_hits += hit_tokens;
                entries.push((id, want));
                budget -= want;
            }
        }
        if admitted_prompt > 0 {
            self.stats.last_hit_rate = admitted_hits as f64 / admitted_prompt as f64;
        }
        if entries.is_empty() {
            return None;
        }
        let (mut prefill_tokens, mut decode_seqs) = (0, 0);
        for (id, n) in &entries {
            let r = &self.reqs[id];
            if *n == 1 && r.num_computed >= r.prompt_len && r.num_computed + 1 == r.tokens.len() {
                decode_seqs += 1;
            } else {
                prefill_tokens += n;
            }
        }
        let lora_loads = self.loras.load(&batch_loras);
        self.stats.lora_loads += lora_loads as u64;
        let duration = self.latency.step_seconds(prefill_tokens, decode_seqs)
            + lora_loads as f64 * self.loras.load_seconds;
        Some(Scheduled {
            entries,
            prefill_tokens,
            decode_seqs,
            lora_loads,
            duration,
        })
    }

    /// Applies a step's results at its end time `now`: samples tokens,
    /// finishes requests. Returns one entry per request that sampled a token.
    pub fn finish_step(&mut self, step: &Scheduled, now: f64) -> Vec<StepOut> {
        self.stats.steps += 1;
        self.stats.busy_seconds += step.duration;
        let mut out = Vec::with_capacity(step.entries.len());
        let sampled_before = self.stats.generation_tokens;
        for &(id, n) in &step.entries {
            let Some(r) = self.reqs.get_mut(&id) else {
                continue;
            };
            r.num_computed += n;
            if r.num_computed < r.tokens.len() {
                continue; // a chunk of the prompt: nothing sampled
            }
            let token = self.vocab.token(r.rng.next_u64());
            r.tokens.push(token);
            r.generated += 1;
            self.stats.generation_tokens += 1;
            match r.last_token {
                None => {
                    self.stats.prompt_tokens += r.prompt_len as u64;
                    if r.first_token.is_none() {
                        r.first_token = Some(now);
                        self.stats.ttft.observe(now - r.arrival);
                    }
                }
                Some(t) => self.stats.itl.observe(now - t),
            }
            r.last_token = Some(now);
            let done = if r.generated >= r.target {
                Some(r.finish_on_target)
            } else if r.tokens.len() >= self.max_model_len {
                Some(FinishReason::Length)
            } else {
                None
            };
            let finished = done.map(|reason| Finished {
                reason,
                prompt_tokens: r.prompt_len,
                completion_tokens: r.generated,
                cached_tokens: r.cached_tokens.unwrap_or(0),
            });
            out.push(StepOut {
                id,
                token,
                finished,
            });
            if let Some(reason) = done {
                self.finish(id, reason, now);
            }
        }
        if step.duration > 0.0 {
            self.stats.gen_throughput =
                (self.stats.generation_tokens - sampled_before) as f64 / step.duration;
        }
        out
    }

    /// Recompute preemption: free the blocks, back to the queue's front.
    fn preempt(&mut self, id: ReqId) {
        let r = self.reqs.get_mut(&id).expect("running request exists");
        self.pool.free(r.blocks.drain(..).rev());
        r.num_computed = 0;
        r.num_cached_blocks = 0;
        r.preemptions += 1;
        self.stats.preemptions += 1;
        self.waiting.push_front(id);
    }
}
