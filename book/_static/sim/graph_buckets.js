// CUDA-graph bucket lookup: the rules of nanoengine.engine.cuda_graphs (graph_buckets, bucket_for) in plain
// JavaScript, so the book's page can run it without a kernel. tests/test_simulators.py checks it against Python.
(function () {
  "use strict";

  // Batch sizes to capture: 1, 2, 4, 8, then multiples of 16, always ending at maxNumSeqs.
  function graphBuckets(maxNumSeqs) {
    if (!Number.isInteger(maxNumSeqs) || maxNumSeqs < 1) throw new Error("max_num_seqs must be a positive integer");
    var sizes = [1, 2, 4, 8].filter(function (b) { return b <= maxNumSeqs; });
    for (var b = 16; b <= maxNumSeqs; b += 16) sizes.push(b);
    if (sizes.indexOf(maxNumSeqs) < 0) sizes.push(maxNumSeqs);
    return sizes.sort(function (x, y) { return x - y; });
  }

  // The smallest captured batch size that holds n sequences.
  function bucketFor(buckets, n) {
    for (var i = 0; i < buckets.length; i++) if (n >= 1 && buckets[i] >= n) return buckets[i];
    throw new Error("a decode batch of " + n + " sequences does not fit the captured sizes 1.." +
                    buckets[buckets.length - 1]);
  }

  function mount(root) {
    var out = root.querySelector("output");
    var list = root.querySelector(".sim-bucket-list");
    function update() {
      var maxNumSeqs = Number(root.querySelector('[name="max_num_seqs"]').value);
      var n = Number(root.querySelector('[name="batch"]').value);
      try {
        var buckets = graphBuckets(maxNumSeqs);
        if (list) list.textContent = "captured sizes (" + buckets.length + " graphs): " + buckets.join(", ");
        var bucket = bucketFor(buckets, n);
        out.dataset.bucket = bucket;
        out.textContent = "a batch of " + n + " replays the graph of " + bucket + " (" + (bucket - n) +
          " padded row" + (bucket - n === 1 ? "" : "s") + ")";
      } catch (e) {
        out.dataset.bucket = "";
        out.textContent = e.message;
      }
    }
    root.addEventListener("input", update);
    update();
  }

  var api = { graphBuckets: graphBuckets, bucketFor: bucketFor };
  if (typeof module !== "undefined" && module.exports) module.exports = api;
  if (typeof document !== "undefined") {
    var start = function () { document.querySelectorAll(".sim-graph-buckets").forEach(mount); };
    if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start); else start();
  }
})();
