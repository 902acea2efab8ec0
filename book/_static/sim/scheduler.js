// Scheduler stepper: the rules of nanoengine.engine.scheduler (Scheduler.schedule and postprocess) and of the
// BlockManager's pool, with prefix caching switched off, in plain JavaScript, so the book's page can step through
// them without a kernel. tests/test_simulators.py checks every step against the Python Scheduler.
(function () {
  "use strict";
  var NAMES = "ABCDEFGHIJKLMNOPQRSTUVWXYZ";
  var COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c",
                "#ccb974", "#64b5cd"];

  function positiveInt(name, value) {
    if (!Number.isInteger(value) || value < 1) throw new Error(name + " must be a positive integer, got " + value);
    return value;
  }

  function ceilDiv(a, b) { return Math.floor((a + b - 1) / b); }

  // A scheduler over a pool of numBlocks blocks of blockSize tokens, every request queued in the order given.
  // config: {numBlocks, blockSize, maxNumSeqs, maxNumBatchedTokens}; requests: [[promptTokens, maxTokens], ...].
  function createScheduler(config, requests) {
    var numBlocks = positiveInt("pool size (blocks)", config.numBlocks);
    var blockSize = positiveInt("block size", config.blockSize);
    if (blockSize & (blockSize - 1)) throw new Error("block size must be a power of two, got " + blockSize);
    positiveInt("max_num_seqs", config.maxNumSeqs);
    positiveInt("token budget (max_num_batched_tokens)", config.maxNumBatchedTokens);
    if (!requests.length) throw new Error("add at least one request");
    if (requests.length > NAMES.length) throw new Error("at most " + NAMES.length + " requests");
    var free = [];
    for (var b = 0; b < numBlocks; b++) free.push(b);
    var st = {
      config: config, free: free, seqs: [], waiting: [], running: [], numSteps: 0, numPreemptions: 0,
    };
    requests.forEach(function (r, i) {
      var name = NAMES[i];
      var prompt = positiveInt("request " + name + "'s prompt length", r[0]);
      var maxTokens = positiveInt("request " + name + "'s max_tokens", r[1]);
      // SchedulerBase.check_request: the last sampled token never needs a slot in the cache
      var needed = ceilDiv(prompt + maxTokens - 1, blockSize);
      if (needed > numBlocks) {
        throw new Error("request " + name + " needs up to " + needed + " KV blocks (" + (prompt + maxTokens - 1) +
                        " tokens in blocks of " + blockSize + ") but the pool has " + numBlocks);
      }
      var seq = {
        id: i, name: name, numPromptTokens: prompt, maxTokens: maxTokens, numTokens: prompt, numCachedTokens: 0,
        numScheduledTokens: 0, isPrefill: true, blockTable: [], status: "waiting",
      };
      st.seqs.push(seq);
      st.waiting.push(seq);
    });
    return st;
  }

  function isFinished(st) { return !st.waiting.length && !st.running.length; }

  // BlockManager without prefix caching: blocks are taken from the front of the free list, given back to its end.
  function takeBlock(st) { return st.free.shift(); }

  function deallocate(st, seq) {
    for (var i = seq.blockTable.length - 1; i >= 0; i--) st.free.push(seq.blockTable[i]);
    seq.blockTable = [];
    seq.numCachedTokens = 0;
  }

  function allocate(st, seq) {
    var need = ceilDiv(seq.numTokens, st.config.blockSize);
    if (st.free.length < need) return false;
    for (var i = 0; i < need; i++) seq.blockTable.push(takeBlock(st));
    seq.numCachedTokens = 0;
    return true;
  }

  function canAppend(st, seq) {
    var held = seq.blockTable.length, bs = st.config.blockSize;
    if (held * bs >= seq.numTokens) return true;
    return st.free.length >= ceilDiv(seq.numTokens, bs) - held;
  }

  function mayAppend(st, seq) {
    while (seq.blockTable.length * st.config.blockSize < seq.numTokens) seq.blockTable.push(takeBlock(st));
  }

  // Recompute preemption: the blocks go back to the pool and the sequence waits first in line.
  function preempt(st, seq) {
    if (seq.status !== "waiting") st.waiting.unshift(seq);
    seq.status = "waiting";
    seq.isPrefill = true;
    seq.numScheduledTokens = 0;
    deallocate(st, seq);
    st.numPreemptions++;
  }

  // Whom to preempt: a half-computed prompt at the head of the queue, else the newest running one, else `decoding`.
  function newestAdmitted(st, decoding) {
    if (st.waiting.length && st.waiting[0].blockTable.length) return st.waiting[0];
    return st.running.length ? st.running.pop() : decoding;
  }

  // One step: schedule() (decodes first, then prompt chunks in what is left of the budget) and postprocess() with
  // a sampled token per finished prompt or decode. Returns what happened, or null when nothing is left to do.
  function step(st) {
    if (isFinished(st)) return null;
    var cfg = st.config;
    st.numSteps++;
    var decodes = [], preempted = [];
    while (st.running.length && decodes.length < cfg.maxNumSeqs) {
      var seq = st.running.shift(), gaveUp = false;
      while (!canAppend(st, seq)) {
        var victim = newestAdmitted(st, seq);
        preempt(st, victim);
        preempted.push(victim);
        if (victim === seq) { gaveUp = true; break; }
      }
      if (gaveUp) continue;
      seq.numScheduledTokens = 1;
      seq.isPrefill = false;
      mayAppend(st, seq);
      decodes.push(seq);
    }
    st.running = decodes.concat(st.running);

    var prefills = [], budget = cfg.maxNumBatchedTokens - decodes.length;
    while (st.waiting.length && decodes.length + prefills.length < cfg.maxNumSeqs && budget > 0) {
      var head = st.waiting[0];
      // a step that preempted admits no one: it would take back the blocks it just freed
      if (!head.blockTable.length && (preempted.length || !allocate(st, head))) break;
      head.numScheduledTokens = Math.min(head.numTokens - head.numCachedTokens, budget);
      budget -= head.numScheduledTokens;
      head.isPrefill = true;
      if (head.numCachedTokens + head.numScheduledTokens === head.numTokens) {
        head.status = "running";
        st.waiting.shift();
        st.running.push(head);
      }
      prefills.push(head);
    }
    var seqs = decodes.concat(prefills);
    if (!seqs.length) throw new Error("scheduler made no progress: no sequence fits the KV cache");

    var scheduled = seqs.map(function (s) {
      return {
        id: s.id, tokens: s.numScheduledTokens, prefill: s.isPrefill,
        last: s.numCachedTokens + s.numScheduledTokens === s.numTokens,
      };
    });
    var numTokens = scheduled.reduce(function (n, s) { return n + s.tokens; }, 0);

    var finished = [];
    seqs.forEach(function (s) {
      s.numCachedTokens += s.numScheduledTokens;
      s.numScheduledTokens = 0;
      if (s.numCachedTokens < s.numTokens) return;  // a chunk that stopped short of the prompt's end
      s.numTokens++;  // the sampled token
      if (s.numTokens - s.numPromptTokens >= s.maxTokens) {
        s.status = "finished";
        deallocate(st, s);
        finished.push(s.id);
      }
    });
    if (finished.length) st.running = st.running.filter(function (s) { return s.status !== "finished"; });
    var ids = function (list) { return list.map(function (s) { return s.id; }); };
    return {
      step: st.numSteps, scheduled: scheduled, numTokens: numTokens, preempted: ids(preempted), finished: finished,
      waiting: ids(st.waiting), running: ids(st.running), freeBlocks: st.free.length,
      blockTables: st.seqs.map(function (s) { return s.blockTable.slice(); }),
      generated: st.seqs.map(function (s) { return s.numTokens - s.numPromptTokens; }),
    };
  }

  // Every step until all requests are finished (at most maxSteps).
  function run(config, requests, maxSteps) {
    var st = createScheduler(config, requests), records = [], r;
    while (records.length < (maxSteps || 10000) && (r = step(st))) records.push(r);
    return records;
  }

  // "10:8, 22:6" -> [[10, 8], [22, 6]]
  function parseRequests(text) {
    return text.split(",").filter(function (p) { return p.trim(); }).map(function (part) {
      var m = /^\s*(\d+)\s*:\s*(\d+)\s*$/.exec(part);
      if (!m) throw new Error("requests are prompt:max_tokens pairs separated by commas, not '" + part.trim() + "'");
      return [Number(m[1]), Number(m[2])];
    });
  }

  // --- the widget -------------------------------------------------------------------------------------------------

  function el(tag, css, text) {
    var e = document.createElement(tag);
    if (css) e.style.cssText = css;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function chip(seq, note) {
    return el("span", "display:inline-block;padding:0 .45em;margin:0 .2em .2em 0;border-radius:4px;color:#fff;" +
              "font-family:monospace;background:" + COLORS[seq.id % COLORS.length], seq.name + (note || ""));
  }

  function mount(root) {
    var out = root.querySelector("output");
    var pool = root.querySelector(".sim-scheduler-pool");
    var queues = root.querySelector(".sim-scheduler-queues");
    var history = root.querySelector(".sim-scheduler-history tbody");
    var stepButton = root.querySelector('[name="step"]'), runButton = root.querySelector('[name="run"]');
    var st = null, budget = 1;

    function describe(r) {
      return r.scheduled.map(function (s) {
        var seq = st.seqs[s.id];
        if (!s.prefill) return seq.name + " decode";
        return seq.name + " prefill " + s.tokens + (s.last ? "" : " (chunk)");
      }).join(", ");
    }

    function draw(r) {
      var n = st.config.numBlocks, used = n - st.free.length;
      out.dataset.step = st.numSteps;
      out.dataset.waiting = st.waiting.map(function (s) { return s.name; }).join("");
      out.dataset.running = st.running.map(function (s) { return s.name; }).join("");
      out.dataset.freeBlocks = st.free.length;
      out.dataset.preemptions = st.numPreemptions;
      out.dataset.done = isFinished(st) ? "yes" : "no";
      if (!r) {
        out.textContent = isFinished(st) ? "all requests finished after " + st.numSteps + " steps"
          : "step 0: every request waits; press Step";
      } else {
        out.textContent = "step " + r.step + ": " + r.numTokens + " of " + budget + " tokens (" + describe(r) + ")" +
          (r.preempted.length ? "; preempted " + r.preempted.map(function (i) { return st.seqs[i].name; }).join(", ") +
           " (its blocks go back, its tokens will be recomputed)" : "") +
          (r.finished.length ? "; finished " + r.finished.map(function (i) { return st.seqs[i].name; }).join(", ")
           : "") + (isFinished(st) ? ". All done." : "");
      }
      // the pool: one cell per block, coloured by the request that holds it
      pool.textContent = "";
      var owner = new Array(n).fill(null);
      st.seqs.forEach(function (s) { s.blockTable.forEach(function (b) { owner[b] = s; }); });
      var cells = el("div", "display:flex;gap:1px;margin:.2em 0");
      owner.forEach(function (s, b) {
        var cell = el("div", "flex:1 1 0;min-width:2px;height:1.4em;font:10px/1.4em monospace;text-align:center;" +
                      "overflow:hidden;color:#fff;border:1px solid " + (s ? "transparent" : "#bbb") + ";background:" +
                      (s ? COLORS[s.id % COLORS.length] : "#fff"), s && n <= 64 ? s.name : "");
        cell.title = "block " + b + (s ? ": " + s.name : ": free");
        cells.append(cell);
      });
      pool.append(el("div", "font-size:.9em", "KV pool: " + used + " of " + n + " blocks used"), cells);
      // the queues, in order
      queues.textContent = "";
      [["running", st.running], ["waiting", st.waiting]].forEach(function (q) {
        var line = el("div", "margin:.2em 0");
        line.append(el("span", "display:inline-block;width:5em;font-size:.9em", q[0]));
        if (!q[1].length) line.append(el("span", "color:#888", "(empty)"));
        q[1].forEach(function (s) {
          var done = s.numTokens - s.numPromptTokens;
          var note = s.status === "running" ? " " + done + "/" + s.maxTokens
            : s.numCachedTokens ? " " + s.numCachedTokens + "/" + s.numTokens + " in cache"
            : done ? " preempted: " + s.numTokens + " to recompute" : "";
          line.append(chip(s, note));
        });
        queues.append(line);
      });
      var fin = st.seqs.filter(function (s) { return s.status === "finished"; });
      if (fin.length) {
        var line = el("div", "margin:.2em 0");
        line.append(el("span", "display:inline-block;width:5em;font-size:.9em", "finished"));
        fin.forEach(function (s) { line.append(chip(s, " " + s.maxTokens + "/" + s.maxTokens)); });
        queues.append(line);
      }
      stepButton.disabled = runButton.disabled = isFinished(st);
    }

    function addRow(r) {
      var tr = el("tr");
      var bar = el("div", "display:flex;height:.9em;width:8em;background:#f0f0f0");
      r.scheduled.forEach(function (s) {
        bar.append(el("div", "width:" + (100 * s.tokens / budget).toFixed(2) + "%;background:" +
                      COLORS[s.id % COLORS.length] + ";opacity:" + (s.prefill ? "0.55" : "1")));
      });
      var cells = [String(r.step), r.numTokens, bar, describe(r),
                   r.preempted.map(function (i) { return st.seqs[i].name; }).join(", "),
                   (st.config.numBlocks - r.freeBlocks) + "/" + st.config.numBlocks];
      cells.forEach(function (c, i) {
        var td = el("td", "padding:.1em .5em;vertical-align:middle" + (i === 4 && c ? ";color:#c44e52" : ""));
        if (typeof c === "object") td.append(c); else td.textContent = c;
        tr.append(td);
      });
      history.append(tr);
    }

    function reset() {
      var num = function (name) { return Number(root.querySelector('[name="' + name + '"]').value); };
      history.textContent = "";
      try {
        st = createScheduler({
          numBlocks: num("num_blocks"), blockSize: num("block_size"), maxNumSeqs: num("max_num_seqs"),
          maxNumBatchedTokens: num("budget"),
        }, parseRequests(root.querySelector('[name="requests"]').value));
        budget = st.config.maxNumBatchedTokens;
        draw(null);
      } catch (e) {
        st = null;
        ["step", "waiting", "running", "freeBlocks", "preemptions", "done"].forEach(function (k) {
          out.dataset[k] = "";
        });
        out.textContent = e.message;
        pool.textContent = queues.textContent = "";
        stepButton.disabled = runButton.disabled = true;
      }
    }

    function advance() {
      if (!st) return false;
      var r = step(st);
      if (r) addRow(r);
      return r;
    }

    stepButton.addEventListener("click", function () { var r = advance(); if (st) draw(r); });
    runButton.addEventListener("click", function () {
      var r, last = null;
      while (st && st.numSteps < 1000 && (r = advance())) last = r;
      if (st) draw(last);
    });
    root.querySelector('[name="reset"]').addEventListener("click", reset);
    root.addEventListener("input", reset);
    reset();
  }

  var api = { createScheduler: createScheduler, step: step, run: run, parseRequests: parseRequests };
  if (typeof module !== "undefined" && module.exports) module.exports = api;
  if (typeof document !== "undefined") {
    var start = function () { document.querySelectorAll(".sim-scheduler").forEach(mount); };
    if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start); else start();
  }
})();
