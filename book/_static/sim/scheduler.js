// Scheduler stepper: the rules of nanoengine.engine.scheduler (Scheduler.schedule and postprocess) and of its
// BlockManager (the pool, reference counts and, when switched on, chained-hash prefix caching) in plain JavaScript,
// so the book's page can step through them without a kernel. tests/test_simulators.py checks every step against
// the Python Scheduler, with prefix caching off and on.
(function () {
  "use strict";
  var NAMES = "ABCDEFGHIJKLMNOPQRSTUVWXYZ";
  var COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c",
                "#ccb974", "#64b5cd"];
  var CACHED_COLOR = "#bee3f8";  // a free block that still holds a full block's K/V (notebook 03's "cached")
  var NO_HASH = null;
  var SAMPLED_TOKEN = 7;  // the fake model's token (the tests drive the Python Scheduler with the same)

  function positiveInt(name, value) {
    if (!Number.isInteger(value) || value < 1) throw new Error(name + " must be a positive integer, got " + value);
    return value;
  }

  function ceilDiv(a, b) { return Math.floor((a + b - 1) / b); }

  // --- the block manager ------------------------------------------------------------------------------------------

  // Chained hash of one block's tokens after the block whose hash is prefixHash (block_manager.hash_block uses a
  // 64-bit xxhash; any deterministic hash of (prefix hash, tokens) gives the same cache hits). Two 32-bit lanes,
  // returned as 16 hex digits.
  function hashBlock(tokenIds, prefixHash) {
    var a = 0x811c9dc5, b = 0x01000193;
    function feed(x) {
      a = Math.imul(a ^ x, 0x9e3779b1); a ^= a >>> 15;
      b = Math.imul(b ^ x, 0x85ebca77); b ^= b >>> 13;
    }
    if (prefixHash !== NO_HASH) { feed(parseInt(prefixHash.slice(0, 8), 16)); feed(parseInt(prefixHash.slice(8), 16)); }
    tokenIds.forEach(feed);
    feed(tokenIds.length);
    var hex = function (x) { return ("0000000" + (x >>> 0).toString(16)).slice(-8); };
    return hex(a) + hex(b);
  }

  function sameTokens(x, y) {
    return x.length === y.length && x.every(function (t, i) { return t === y[i]; });
  }

  // Token ids of logical block i of a sequence (the last one may be partial): Sequence.block.
  function blockTokens(st, seq, i) {
    var bs = st.config.blockSize;
    return seq.tokenIds.slice(i * bs, (i + 1) * bs);
  }

  // True when a block's contents can still be found through the prefix cache (_BlockPool.is_cached).
  function isCached(st, b) {
    var block = st.blocks[b];
    return block.hash !== NO_HASH && st.hashToBlock[block.hash] === b;
  }

  // Take the least recently freed block for `seq`; the prefix it held, if any, is evicted from the cache.
  function takeBlock(st, seq) {
    var b = st.free.shift(), block = st.blocks[b];
    if (isCached(st, b)) { delete st.hashToBlock[block.hash]; st.numEvictedBlocks++; }
    block.refCount = 1; block.hash = NO_HASH; block.tokenIds = []; block.owner = seq.id;
    return b;
  }

  // The blocks that already hold the K/V of the sequence's leading full blocks. The last block is never matched, even
  // when it is full (_match_prefix: range(num_blocks - 1)): its tokens are always recomputed, so the prefill that
  // follows has at least one token, whose logits give the next token.
  function matchPrefix(st, seq) {
    var matched = [];
    if (!st.config.prefixCaching) return matched;
    var h = NO_HASH, n = ceilDiv(seq.numTokens, st.config.blockSize);
    for (var i = 0; i < n - 1; i++) {
      var tokens = blockTokens(st, seq, i);
      h = hashBlock(tokens, h);
      var b = st.hashToBlock[h];
      if (b === undefined || !sameTokens(st.blocks[b].tokenIds, tokens)) break;
      matched.push(b);
    }
    return matched;
  }

  // Give a sequence its block table: its cached prefix blocks (reference count + 1, taken back from the free list if
  // nobody holds them) and fresh blocks for the rest. False, changing nothing, when that does not fit.
  function allocate(st, seq) {
    var matched = matchPrefix(st, seq), need = ceilDiv(seq.numTokens, st.config.blockSize) - matched.length;
    var revived = matched.filter(function (b) { return st.blocks[b].refCount === 0; }).length;
    if (st.free.length < revived + need) return false;
    matched.forEach(function (b) {
      if (st.blocks[b].refCount === 0) st.free.splice(st.free.indexOf(b), 1);
      st.blocks[b].refCount++;
    });
    seq.blockTable = matched.slice();
    for (var i = 0; i < need; i++) seq.blockTable.push(takeBlock(st, seq));
    seq.numCachedTokens = matched.length * st.config.blockSize;
    st.numHitBlocks += matched.length;
    return true;
  }

  // Drop the sequence's claim on its blocks, tail first: a block nobody holds goes to the back of the free list and
  // keeps its hash, so it can be found again until takeBlock reuses it (the prefix is evicted last).
  function deallocate(st, seq) {
    for (var i = seq.blockTable.length - 1; i >= 0; i--) {
      var b = seq.blockTable[i];
      if (--st.blocks[b].refCount === 0) st.free.push(b);
    }
    seq.blockTable = [];
    seq.numCachedTokens = 0;
  }

  function canAppend(st, seq) {
    var held = seq.blockTable.length, bs = st.config.blockSize;
    if (held * bs >= seq.numTokens) return true;
    return st.free.length >= ceilDiv(seq.numTokens, bs) - held;
  }

  function mayAppend(st, seq) {
    while (seq.blockTable.length * st.config.blockSize < seq.numTokens) seq.blockTable.push(takeBlock(st, seq));
  }

  // Publish the blocks this step's tokens completed (hash_blocks), so later prompts and re-admissions can reuse them.
  function hashBlocks(st, seq) {
    var bs = st.config.blockSize;
    var start = Math.floor(seq.numCachedTokens / bs);
    var end = Math.floor((seq.numCachedTokens + seq.numScheduledTokens) / bs);
    if (start === end || !st.config.prefixCaching) return;
    var h = start > 0 ? st.blocks[seq.blockTable[start - 1]].hash : NO_HASH;
    for (var i = start; i < end; i++) {
      var b = seq.blockTable[i], tokens = blockTokens(st, seq, i);
      h = hashBlock(tokens, h);
      st.blocks[b].hash = h; st.blocks[b].tokenIds = tokens;
      st.hashToBlock[h] = b;
    }
  }

  // Free blocks whose K/V a later prompt can still take back.
  function numCachedFreeBlocks(st) {
    return st.free.filter(function (b) { return isCached(st, b); }).length;
  }

  // --- the scheduler ----------------------------------------------------------------------------------------------

  // A scheduler over a pool of numBlocks blocks of blockSize tokens, every request queued in the order given.
  // config: {numBlocks, blockSize, maxNumSeqs, maxNumBatchedTokens, prefixCaching (default false), sharedPrefix
  // (default 0: the number of leading prompt tokens all requests have in common)}; requests: [[prompt, maxTokens]...].
  // Each prompt's other tokens are its own, so two requests share at most those sharedPrefix tokens.
  function createScheduler(config, requests) {
    var numBlocks = positiveInt("pool size (blocks)", config.numBlocks);
    var blockSize = positiveInt("block size", config.blockSize);
    if (blockSize & (blockSize - 1)) throw new Error("block size must be a power of two, got " + blockSize);
    positiveInt("max_num_seqs", config.maxNumSeqs);
    positiveInt("token budget (max_num_batched_tokens)", config.maxNumBatchedTokens);
    var shared = config.sharedPrefix || 0;
    if (!Number.isInteger(shared) || shared < 0) {
      throw new Error("shared prompt prefix must be an integer >= 0, got " + shared);
    }
    if (!requests.length) throw new Error("add at least one request");
    if (requests.length > NAMES.length) throw new Error("at most " + NAMES.length + " requests");
    var st = {
      config: Object.assign({}, config, {prefixCaching: !!config.prefixCaching, sharedPrefix: shared}),
      free: [], blocks: [], hashToBlock: {}, numHitBlocks: 0, numEvictedBlocks: 0,
      seqs: [], waiting: [], running: [], numSteps: 0, numPreemptions: 0,
    };
    for (var b = 0; b < numBlocks; b++) {
      st.free.push(b);
      st.blocks.push({refCount: 0, hash: NO_HASH, tokenIds: [], owner: null});
    }
    requests.forEach(function (r, i) {
      var name = NAMES[i];
      var prompt = positiveInt("request " + name + "'s prompt length", r[0]);
      var maxTokens = positiveInt("request " + name + "'s max_tokens", r[1]);
      // Scheduler.check_request: the last sampled token never needs a slot in the cache
      var needed = ceilDiv(prompt + maxTokens - 1, blockSize);
      if (needed > numBlocks) {
        throw new Error("request " + name + " needs up to " + needed + " KV blocks (" + (prompt + maxTokens - 1) +
                        " tokens in blocks of " + blockSize + ") but the pool has " + numBlocks);
      }
      var tokenIds = [];
      for (var t = 0; t < prompt; t++) tokenIds.push(t < shared ? 1 + t : 1000 * (i + 1) + t);
      var seq = {
        id: i, name: name, tokenIds: tokenIds, numPromptTokens: prompt, maxTokens: maxTokens, numTokens: prompt,
        numCachedTokens: 0, numScheduledTokens: 0, isPrefill: true, blockTable: [], status: "waiting",
        numPreemptions: 0,
      };
      st.seqs.push(seq);
      st.waiting.push(seq);
    });
    return st;
  }

  function isFinished(st) { return !st.waiting.length && !st.running.length; }

  // Recompute preemption: the blocks go back to the pool (with prefix caching, their full blocks stay findable) and
  // the sequence waits first in line.
  function preempt(st, seq) {
    if (seq.status !== "waiting") st.waiting.unshift(seq);
    seq.status = "waiting";
    seq.isPrefill = true;
    seq.numScheduledTokens = 0;
    deallocate(st, seq);
    seq.numPreemptions++;
    st.numPreemptions++;
  }

  // Whom to preempt: a half-computed prompt at the head of the queue, else the newest running one, else `decoding`.
  function newestAdmitted(st, decoding) {
    if (st.waiting.length && st.waiting[0].blockTable.length) return st.waiting[0];
    return st.running.length ? st.running.pop() : decoding;
  }

  // schedule(), first half: one decode token per running sequence, preempting the newest when a block is missing.
  function scheduleDecodes(st, preempted) {
    var decodes = [];
    while (st.running.length && decodes.length < st.config.maxNumSeqs) {
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
    return decodes;
  }

  // schedule(), second half: prompt chunks from the head of the queue in what is left of the budget. A sequence
  // admitted now (allocate) may start with numCachedTokens > 0: the tokens the prefix cache already holds.
  function schedulePrefills(st, numDecodes, preempted, admitted) {
    var cfg = st.config, prefills = [], budget = cfg.maxNumBatchedTokens - numDecodes;
    while (st.waiting.length && numDecodes + prefills.length < cfg.maxNumSeqs && budget > 0) {
      var head = st.waiting[0];
      if (!head.blockTable.length) {
        // a step that preempted admits no one: it would take back the blocks it just freed
        if (preempted.length || !allocate(st, head)) break;
        admitted.push({
          id: head.id, cachedTokens: head.numCachedTokens, numTokens: head.numTokens,
          readmitted: head.numPreemptions > 0,
        });
      }
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
    return prefills;
  }

  // postprocess(): publish the full blocks, count the computed tokens, append a sampled token to each sequence whose
  // prompt is done, retire those with their max_tokens. Returns the ids of the finished ones.
  function postprocess(st, seqs) {
    var finished = [];
    seqs.forEach(function (s) {
      hashBlocks(st, s);
      s.numCachedTokens += s.numScheduledTokens;
      s.numScheduledTokens = 0;
      if (s.numCachedTokens < s.numTokens) return;  // a chunk that stopped short of the prompt's end
      s.tokenIds.push(SAMPLED_TOKEN);
      s.numTokens++;
      if (s.numTokens - s.numPromptTokens >= s.maxTokens) {
        s.status = "finished";
        deallocate(st, s);
        finished.push(s.id);
      }
    });
    if (finished.length) st.running = st.running.filter(function (s) { return s.status !== "finished"; });
    return finished;
  }

  // One step: schedule() (decodes first, then prompt chunks in what is left of the budget) and postprocess() with
  // a sampled token per finished prompt or decode. Returns what happened, or null when nothing is left to do.
  // With prefix caching on, the record also has `admitted` (who got blocks this step, and how many of their tokens
  // came from the cache), `cachedBlocks` (free blocks still cached), and the pool's hit and eviction counters.
  function step(st) {
    if (isFinished(st)) return null;
    st.numSteps++;
    var preempted = [], admitted = [];
    var decodes = scheduleDecodes(st, preempted);
    var prefills = schedulePrefills(st, decodes.length, preempted, admitted);
    var seqs = decodes.concat(prefills);
    if (!seqs.length) throw new Error("scheduler made no progress: no sequence fits the KV cache");

    var scheduled = seqs.map(function (s) {
      return {
        id: s.id, tokens: s.numScheduledTokens, prefill: s.isPrefill,
        last: s.numCachedTokens + s.numScheduledTokens === s.numTokens,
      };
    });
    var numTokens = scheduled.reduce(function (n, s) { return n + s.tokens; }, 0);
    var finished = postprocess(st, seqs);
    var ids = function (list) { return list.map(function (s) { return s.id; }); };
    var record = {
      step: st.numSteps, scheduled: scheduled, numTokens: numTokens, preempted: ids(preempted), finished: finished,
      waiting: ids(st.waiting), running: ids(st.running), freeBlocks: st.free.length,
      blockTables: st.seqs.map(function (s) { return s.blockTable.slice(); }),
      generated: st.seqs.map(function (s) { return s.numTokens - s.numPromptTokens; }),
    };
    if (st.config.prefixCaching) {
      Object.assign(record, {
        admitted: admitted, cachedBlocks: numCachedFreeBlocks(st), hitBlocks: st.numHitBlocks,
        evictedBlocks: st.numEvictedBlocks,
      });
    }
    return record;
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

  // The preset: the page's requests in a pool of 10 blocks with prefix caching on. At step 6 B, the newest running
  // request, is preempted; its full blocks stay cached while free, and at step 9 it is re-admitted with 20 of its 25
  // tokens from the cache (tests/test_simulators.py checks this against the Python Scheduler).
  var PRESET = {
    num_blocks: 10, block_size: 4, budget: 16, max_num_seqs: 8, shared_prefix: 0, prefix_caching: true,
    requests: "10:8, 22:6, 7:10, 16:5",
  };

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

  function swatch(css, text) {
    var item = el("span", "display:inline-flex;align-items:center;gap:.3em;margin-right:1em");
    item.append(el("span", "display:inline-block;width:1.1em;height:1em;" + css), el("span", "", text));
    return item;
  }

  // The controls that pages written before prefix caching lack (a caching toggle, a shared prefix, the preset), each
  // added only when the page does not have it.
  function ensureControls(root) {
    var grid = root.querySelector("div");
    var add = function (name, type, text, css) {
      if (root.querySelector('[name="' + name + '"]')) return;
      var input = el("input", css || "");
      input.type = type; input.name = name; input.id = "sim-sch-" + name;
      var label = el("label", "", text);
      label.htmlFor = input.id;
      grid.append(label, input);
      return input;
    };
    add("prefix_caching", "checkbox", "prefix caching", "justify-self:start");
    var shared = add("shared_prefix", "number", "shared prompt prefix (tokens)");
    if (shared) { shared.value = "0"; shared.min = "0"; shared.step = "1"; }
    if (!root.querySelector('[name="preset"]')) {
      var preset = el("button", "padding:.2em 1em", "Preset: preempted, then re-admitted from the cache");
      preset.type = "button"; preset.name = "preset";
      root.querySelector('[name="reset"]').after(preset);
    }
  }

  function mount(root) {
    ensureControls(root);
    var out = root.querySelector("output");
    var pool = root.querySelector(".sim-scheduler-pool");
    var queues = root.querySelector(".sim-scheduler-queues");
    var history = root.querySelector(".sim-scheduler-history tbody");
    var stepButton = root.querySelector('[name="step"]'), runButton = root.querySelector('[name="run"]');
    var st = null, budget = 1;
    var input = function (name) { return root.querySelector('[name="' + name + '"]'); };
    var nameOf = function (i) { return st.seqs[i].name; };

    // The admission (blocks given this step) of sequence `id` with tokens from the prefix cache, if any.
    function cacheHit(r, id) {
      return (r.admitted || []).filter(function (a) { return a.id === id && a.cachedTokens; })[0];
    }

    function describe(r) {
      return r.scheduled.map(function (s) {
        if (!s.prefill) return nameOf(s.id) + " decode";
        var hit = cacheHit(r, s.id);
        return nameOf(s.id) + " prefill " + s.tokens + (s.last ? "" : " (chunk)") +
          (hit ? " (+" + hit.cachedTokens + " cached)" : "");
      }).join(", ");
    }

    // "B re-admitted: 20 of 25 tokens from the cache", for every admission the prefix cache had a say in.
    function admissions(r) {
      return (r.admitted || []).filter(function (a) { return a.readmitted || a.cachedTokens; }).map(function (a) {
        return "; " + nameOf(a.id) + (a.readmitted ? " re-admitted: " : " admitted: ") + a.cachedTokens + " of " +
          a.numTokens + " tokens from the cache" + (a.readmitted && !a.cachedTokens ? " (its blocks were reused)" : "");
      }).join("");
    }

    function message(r) {
      if (!r) {
        return isFinished(st) ? "all requests finished after " + st.numSteps + " steps"
          : "step 0: every request waits; press Step";
      }
      var caching = st.config.prefixCaching;
      return "step " + r.step + ": " + r.numTokens + " of " + budget + " tokens (" + describe(r) + ")" +
        admissions(r) +
        (r.preempted.length ? "; preempted " + r.preempted.map(nameOf).join(", ") +
         (caching ? " (its blocks go back; the full ones stay in the cache until they are reallocated)"
          : " (its blocks go back, its tokens will be recomputed)") : "") +
        (r.finished.length ? "; finished " + r.finished.map(nameOf).join(", ") : "") +
        (isFinished(st) ? ". All done." : "");
    }

    // One cell per block: held (its request's colour, framed when shared), cached and free (light blue, the letter
    // of the request whose tokens it holds), or free.
    function drawPool() {
      var n = st.config.numBlocks, holders = [];
      for (var b = 0; b < n; b++) holders.push([]);
      st.seqs.forEach(function (s) { s.blockTable.forEach(function (b) { holders[b].push(s); }); });
      var cells = el("div", "display:flex;gap:1px;margin:.2em 0");
      holders.forEach(function (hs, b) {
        var cached = !hs.length && isCached(st, b), owner = cached ? st.seqs[st.blocks[b].owner] : hs[0];
        var css = "flex:1 1 0;min-width:2px;height:1.4em;font:10px/1.4em monospace;text-align:center;overflow:hidden;";
        if (hs.length) {
          css += "color:#fff;border:1px solid transparent;background:" + COLORS[owner.id % COLORS.length] +
            (hs.length > 1 ? ";box-shadow:inset 0 0 0 2px #1a202c" : "");
        } else if (cached) {
          css += "color:" + COLORS[owner.id % COLORS.length] + ";font-weight:bold;border:1px dashed #4a90c2;" +
            "background:" + CACHED_COLOR;
        } else {
          css += "border:1px solid #bbb;background:#fff";
        }
        var label = hs.length ? hs.map(function (s) { return s.name; }).join("") : cached ? owner.name : "";
        var cell = el("div", css, n <= 64 ? label : "");
        cell.title = "block " + b + ": " + (hs.length ? "held by " + label
          : cached ? "cached, free (a full block of " + owner.name + "'s tokens, reusable until reallocated)" : "free");
        cells.append(cell);
      });
      var numCached = numCachedFreeBlocks(st);
      pool.append(el("div", "font-size:.9em", "KV pool: " + (n - st.free.length) + " of " + n + " blocks used" +
                     (st.config.prefixCaching ? "; " + numCached + " free " + (numCached === 1 ? "block" : "blocks") +
                      " still cached" : "")), cells);
      var legend = el("div", "font-size:.8em;color:#4a5568;margin-bottom:.3em");
      legend.append(swatch("background:" + COLORS[0], "held (its request's colour)"),
                    swatch("border:1px solid #bbb;background:#fff", "free"));
      if (st.config.prefixCaching) {
        legend.append(swatch("border:1px dashed #4a90c2;background:" + CACHED_COLOR, "cached, free"),
                      swatch("background:" + COLORS[0] + ";box-shadow:inset 0 0 0 2px #1a202c", "shared"));
      }
      pool.append(legend);
    }

    function chipNote(s) {
      var done = s.numTokens - s.numPromptTokens;
      if (s.status === "running") return " " + done + "/" + s.maxTokens;
      if (s.numCachedTokens) return " " + s.numCachedTokens + "/" + s.numTokens + " in cache";
      // not admitted yet: how much of it the prefix cache could serve now (it shrinks as its blocks are reused)
      var cached = matchPrefix(st, s).length * st.config.blockSize;
      if (s.numPreemptions) {
        return " preempted: " + s.numTokens + (st.config.prefixCaching ? " tokens, " + cached + " still cached"
          : " to recompute");
      }
      return cached ? " " + cached + " of " + s.numTokens + " cached" : "";
    }

    function drawQueues() {
      var lists = [["running", st.running], ["waiting", st.waiting],
                   ["finished", st.seqs.filter(function (s) { return s.status === "finished"; })]];
      lists.forEach(function (q) {
        if (q[0] === "finished" && !q[1].length) return;
        var line = el("div", "margin:.2em 0");
        line.append(el("span", "display:inline-block;width:5em;font-size:.9em", q[0]));
        if (!q[1].length) line.append(el("span", "color:#888", "(empty)"));
        q[1].forEach(function (s) {
          line.append(chip(s, s.status === "finished" ? " " + s.maxTokens + "/" + s.maxTokens : chipNote(s)));
        });
        queues.append(line);
      });
    }

    function draw(r) {
      out.dataset.step = st.numSteps;
      out.dataset.waiting = st.waiting.map(function (s) { return s.name; }).join("");
      out.dataset.running = st.running.map(function (s) { return s.name; }).join("");
      out.dataset.freeBlocks = st.free.length;
      out.dataset.preemptions = st.numPreemptions;
      out.dataset.cachedBlocks = numCachedFreeBlocks(st);
      out.dataset.cacheHitTokens = st.numHitBlocks * st.config.blockSize;
      out.dataset.done = isFinished(st) ? "yes" : "no";
      out.textContent = message(r);
      pool.textContent = queues.textContent = "";
      drawPool();
      drawQueues();
      stepButton.disabled = runButton.disabled = isFinished(st);
    }

    function addRow(r) {
      var tr = el("tr");
      var bar = el("div", "display:flex;height:.9em;width:8em;background:#f0f0f0");
      r.scheduled.forEach(function (s) {
        bar.append(el("div", "width:" + (100 * s.tokens / budget).toFixed(2) + "%;background:" +
                      COLORS[s.id % COLORS.length] + ";opacity:" + (s.prefill ? "0.55" : "1")));
      });
      var cells = [String(r.step), r.numTokens, bar, describe(r), r.preempted.map(nameOf).join(", "),
                   (st.config.numBlocks - r.freeBlocks) + "/" + st.config.numBlocks];
      cells.forEach(function (c, i) {
        var td = el("td", "padding:.1em .5em;vertical-align:middle" + (i === 4 && c ? ";color:#c44e52" : ""));
        if (typeof c === "object") td.append(c); else td.textContent = c;
        tr.append(td);
      });
      history.append(tr);
    }

    function reset() {
      var num = function (name) { return Number(input(name).value); };
      history.textContent = "";
      try {
        st = createScheduler({
          numBlocks: num("num_blocks"), blockSize: num("block_size"), maxNumSeqs: num("max_num_seqs"),
          maxNumBatchedTokens: num("budget"), prefixCaching: input("prefix_caching").checked,
          sharedPrefix: num("shared_prefix"),
        }, parseRequests(input("requests").value));
        budget = st.config.maxNumBatchedTokens;
        draw(null);
      } catch (e) {
        st = null;
        ["step", "waiting", "running", "freeBlocks", "preemptions", "cachedBlocks", "cacheHitTokens", "done"]
          .forEach(function (k) { out.dataset[k] = ""; });
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
    input("reset").addEventListener("click", reset);
    input("preset").addEventListener("click", function () {
      Object.keys(PRESET).forEach(function (k) {
        if (k === "prefix_caching") input(k).checked = PRESET[k]; else input(k).value = PRESET[k];
      });
      reset();
    });
    root.addEventListener("input", reset);
    reset();
  }

  var api = {
    createScheduler: createScheduler, step: step, run: run, parseRequests: parseRequests, hashBlock: hashBlock,
    PRESET: PRESET,
  };
  if (typeof module !== "undefined" && module.exports) module.exports = api;
  if (typeof document !== "undefined") {
    var start = function () { document.querySelectorAll(".sim-scheduler").forEach(mount); };
    if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start); else start();
  }
})();
