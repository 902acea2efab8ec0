// Temperature race: the sampler's temperature rule (nanoengine.layers.sampler: softmax of logits / T, greedy argmax
// at T = 0) in plain JavaScript, so the book's page can run it without a kernel. tests/test_simulators.py checks it
// against torch.softmax.
(function () {
  "use strict";

  // The greedy pick: the index of the largest logit (the first one on a tie, as torch.argmax).
  function greedy(logits) {
    var best = 0;
    for (var i = 1; i < logits.length; i++) if (logits[i] > logits[best]) best = i;
    return best;
  }

  // Probabilities of each token at temperature T: softmax(logits / T); at T = 0 all mass on the greedy pick.
  function probabilities(logits, temperature) {
    if (!(temperature >= 0)) throw new Error("temperature must be >= 0, got " + temperature);
    if (temperature === 0) return logits.map(function (_, i) { return i === greedy(logits) ? 1 : 0; });
    var scaled = logits.map(function (x) { return x / temperature; });
    var top = Math.max.apply(null, scaled);
    var exps = scaled.map(function (x) { return Math.exp(x - top); });
    var total = exps.reduce(function (a, b) { return a + b; }, 0);
    return exps.map(function (e) { return e / total; });
  }

  function mount(root) {
    var out = root.querySelector("output");
    var bars = root.querySelector(".sim-temperature-bars");
    function update() {
      var words = root.querySelector('[name="words"]').value.split(",").map(function (w) { return w.trim(); });
      var logits = root.querySelector('[name="logits"]').value.split(",").map(Number);
      var temperature = Number(root.querySelector('[name="temperature"]').value);
      try {
        if (logits.some(isNaN)) throw new Error("logits must be numbers separated by commas");
        var probs = probabilities(logits, temperature);
        var pick = greedy(logits);
        out.dataset.probs = probs.map(function (p) { return p.toFixed(4); }).join(",");
        out.dataset.greedy = pick;
        out.textContent = "T = " + temperature + ": " + probs.map(function (p, i) {
          return (words[i] || "#" + i) + " " + (100 * p).toFixed(1) + "%";
        }).join(", ") + (temperature === 0 ? " (greedy: always " + (words[pick] || "#" + pick) + ")" : "");
        if (bars) {
          bars.textContent = "";
          probs.forEach(function (p, i) {
            var row = document.createElement("div");
            row.style.cssText = "display:flex;align-items:center;gap:.5em;font-family:monospace";
            var label = document.createElement("span");
            label.style.cssText = "width:6em;text-align:right";
            label.textContent = words[i] || "#" + i;
            var bar = document.createElement("span");
            bar.style.cssText = "display:inline-block;height:.9em;background:#4c72b0;width:" + (p * 300).toFixed(1) + "px";
            row.append(label, bar, document.createTextNode((100 * p).toFixed(1) + "%"));
            bars.append(row);
          });
        }
      } catch (e) {
        out.dataset.probs = out.dataset.greedy = "";
        out.textContent = e.message;
      }
    }
    root.addEventListener("input", update);
    update();
  }

  var api = { greedy: greedy, probabilities: probabilities };
  if (typeof module !== "undefined" && module.exports) module.exports = api;
  if (typeof document !== "undefined") {
    var start = function () { document.querySelectorAll(".sim-temperature").forEach(mount); };
    if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start); else start();
  }
})();
