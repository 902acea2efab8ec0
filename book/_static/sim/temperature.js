// Temperature race: the sampler's rules (nanoengine.layers.sampler: softmax of logits / T, greedy argmax at T = 0,
// then apply_top_k_top_p's top-k and top-p filters) in plain JavaScript, so the book's page can run them without a
// kernel. tests/test_simulators.py checks them against torch.softmax and the engine's apply_top_k_top_p.
(function () {
  "use strict";
  var BAR_PX = 300;  // the width of a bar at probability 1

  // The greedy pick: the index of the largest logit (the first one on a tie, as torch.argmax).
  function greedy(logits) {
    var best = 0;
    for (var i = 1; i < logits.length; i++) if (logits[i] > logits[best]) best = i;
    return best;
  }

  function softmax(xs) {
    var top = Math.max.apply(null, xs);
    var exps = xs.map(function (x) { return x === -Infinity ? 0 : Math.exp(x - top); });
    var total = exps.reduce(function (a, b) { return a + b; }, 0);
    return exps.map(function (e) { return e / total; });
  }

  // Probabilities of each token at temperature T: softmax(logits / T); at T = 0 all mass on the greedy pick.
  function probabilities(logits, temperature) {
    if (!(temperature >= 0)) throw new Error("temperature must be >= 0, got " + temperature);
    if (temperature === 0) return logits.map(function (_, i) { return i === greedy(logits) ? 1 : 0; });
    return softmax(logits.map(function (x) { return x / temperature; }));
  }

  // The smallest scaled logit that survives, as apply_top_k_top_p computes it: the k-th largest for top-k, then
  // for top-p the last token of the nucleus over the top-k survivors' renormalised probabilities. The nucleus is
  // every token whose mass *before* it is below top_p, so the token that crosses top_p is kept, and so is the top
  // token, whatever top_p is. Every token equal to the threshold survives: ties at the cut are all kept.
  function threshold(scaled, topK, topP) {
    var ranked = scaled.slice().sort(function (a, b) { return b - a; });
    var cut = -Infinity;
    if (topK >= 1) {
      cut = ranked[Math.min(topK, ranked.length) - 1];
      ranked = ranked.map(function (x) { return x < cut ? -Infinity : x; });
    }
    if (topP < 1) {
      // the mass before each ranked token as the engine computes it (cumsum - probs), counted where below top_p
      var probs = softmax(ranked), cumsum = 0, numKept = 0;
      for (var i = 0; i < probs.length; i++) {
        cumsum += probs[i];
        if (cumsum - probs[i] < topP) numKept++;
      }
      cut = Math.max(cut, ranked[Math.max(numKept, 1) - 1]);
    }
    return cut;
  }

  // What the sampler draws from: `before`, the probabilities at temperature T; `kept[i]`, whether token i survives
  // top-k (topK < 1: off) and top-p (topP >= 1: off); `probs`, the survivors' probabilities renormalised. At T = 0
  // the sampler takes the greedy pick and ignores both filters (a greedy row's top-k and top-p are switched off).
  function distribution(logits, temperature, topK, topP) {
    if (!(topP > 0 && topP <= 1)) throw new Error("top-p must be in (0, 1], got " + topP);
    var before = probabilities(logits, temperature);
    if (temperature === 0) {
      return {before: before, kept: before.map(function (p) { return p === 1; }), probs: before};
    }
    var scaled = logits.map(function (x) { return x / temperature; });
    var cut = threshold(scaled, topK, topP);
    var kept = scaled.map(function (x) { return x >= cut; });
    var probs = softmax(scaled.map(function (x, i) { return kept[i] ? x : -Infinity; }));
    return {before: before, kept: kept, probs: probs};
  }

  // --- the widget -------------------------------------------------------------------------------------------------

  function el(tag, css, text) {
    var e = document.createElement(tag);
    if (css) e.style.cssText = css;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  // The top-k and top-p sliders, added to the controls' grid when the page does not have them.
  function ensureControls(root) {
    var grid = root.querySelector("div");
    [["top_k", "top-k", "0", "20", "1", "0"], ["top_p", "top-p", "0.01", "1", "0.01", "1"]].forEach(function (c) {
      if (root.querySelector('[name="' + c[0] + '"]')) return;
      var label = el("label", "", c[1]), slider = el("input", "width:16em");
      slider.type = "range"; slider.name = c[0]; slider.id = "sim-" + c[0];
      slider.min = c[2]; slider.max = c[3]; slider.step = c[4]; slider.value = c[5];
      label.htmlFor = slider.id;
      var value = el("span", "font-family:monospace"), cell = el("span", "display:flex;align-items:center;gap:.6em");
      value.className = "sim-" + c[0] + "-value";
      cell.append(slider, value);
      grid.append(label, cell);
    });
  }

  function pct(p) { return (100 * p).toFixed(1) + "%"; }

  // One row per token: a kept one in blue at its renormalised probability, a removed one greyed at what it had.
  function drawBars(bars, words, d, filtered) {
    bars.textContent = "";
    d.probs.forEach(function (p, i) {
      var kept = d.kept[i], row = el("div", "display:flex;align-items:center;gap:.5em;font-family:monospace;" +
                                       (kept ? "" : "color:#999"));
      var shown = kept ? p : d.before[i];
      var bar = el("span", "display:inline-block;height:.9em;background:" + (kept ? "#4c72b0" : "#d0d0d0") +
                   ";width:" + (shown * BAR_PX).toFixed(1) + "px");
      var text = !filtered ? pct(p) : kept ? pct(p) + " (was " + pct(d.before[i]) + ")"
        : "removed (was " + pct(d.before[i]) + ")";
      row.append(el("span", "width:6em;text-align:right", words[i] || "#" + i), bar, document.createTextNode(text));
      bars.append(row);
    });
  }

  // "T = 1, top-k 3: 3 of 20 tokens kept, renormalised: mat 45.1%, ..." (the filters are named when they act)
  function summary(temperature, topK, topP, items, keptNote) {
    var filters = temperature > 0 ? (topK >= 1 ? ", top-k " + topK : "") + (topP < 1 ? ", top-p " + topP : "") : "";
    return "T = " + temperature + filters + ": " + keptNote + items.join(", ");
  }

  function mount(root) {
    ensureControls(root);
    var out = root.querySelector("output");
    var bars = root.querySelector(".sim-temperature-bars");
    var input = function (name) { return root.querySelector('[name="' + name + '"]'); };
    function update() {
      var words = input("words").value.split(",").map(function (w) { return w.trim(); });
      var logits = input("logits").value.split(",").map(Number);
      var temperature = Number(input("temperature").value);
      var topK = Number(input("top_k").value), topP = Number(input("top_p").value);
      input("top_k").max = String(logits.length);
      var shown = [[".sim-top_k-value", topK >= 1 ? String(topK) : "off"],
                   [".sim-top_p-value", topP < 1 ? topP.toFixed(2) : "off"]];
      shown.forEach(function (v) { var e = root.querySelector(v[0]); if (e) e.textContent = v[1]; });
      try {
        if (logits.some(isNaN)) throw new Error("logits must be numbers separated by commas");
        var d = distribution(logits, temperature, topK, topP);
        var pick = greedy(logits), name = function (i) { return words[i] || "#" + i; };
        var survivors = d.kept.map(function (k, i) { return k ? i : -1; }).filter(function (i) { return i >= 0; });
        var filtered = temperature > 0 && survivors.length < logits.length;
        out.dataset.probs = d.probs.map(function (p) { return p.toFixed(4); }).join(",");
        out.dataset.greedy = pick;
        out.dataset.kept = survivors.join(",");
        out.textContent = summary(temperature, topK, topP, survivors.map(function (i) {
          return name(i) + " " + pct(d.probs[i]);
        }), filtered ? survivors.length + " of " + logits.length + " tokens kept, renormalised: " : "") +
          (temperature === 0 ? " (greedy: always " + name(pick) + ")" : "");
        if (bars) drawBars(bars, words, d, filtered);
      } catch (e) {
        out.dataset.probs = out.dataset.greedy = out.dataset.kept = "";
        out.textContent = e.message;
      }
    }
    root.addEventListener("input", update);
    update();
  }

  var api = {greedy: greedy, probabilities: probabilities, distribution: distribution};
  if (typeof module !== "undefined" && module.exports) module.exports = api;
  if (typeof document !== "undefined") {
    var start = function () { document.querySelectorAll(".sim-temperature").forEach(mount); };
    if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start); else start();
  }
})();
