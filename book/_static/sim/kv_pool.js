// KV-pool calculator: the rules of nanoengine.utils.memory (kv_cache_bytes_per_token, plan_kv_pool) in plain
// JavaScript, so the book's page can run it without a kernel. tests/test_simulators.py checks it against Python.
(function () {
  "use strict";
  var GIB = Math.pow(2, 30);

  function positiveInt(name, value) {
    if (!Number.isInteger(value) || value < 1) throw new Error(name + " must be a positive integer, got " + value);
    return value;
  }

  // Bytes of keys and values of one token, all layers, in one tensor-parallel rank's cache.
  function bytesPerToken(numLayers, numKvHeads, headDim, dtypeBytes, tensorParallelSize) {
    positiveInt("layers", numLayers); positiveInt("KV heads", numKvHeads); positiveInt("head dim", headDim);
    positiveInt("dtype bytes", dtypeBytes); positiveInt("tensor parallel size", tensorParallelSize);
    if (numKvHeads % tensorParallelSize) {
      throw new Error("tensor parallel size (" + tensorParallelSize + ") must divide KV heads (" + numKvHeads + ")");
    }
    return 2 * numLayers * (numKvHeads / tensorParallelSize) * headDim * dtypeBytes;
  }

  // plan_kv_pool: the pool is what `utilization` of the GPU leaves after weights and activations, in whole blocks.
  function planKVPool(gpuBytes, weightBytes, activationBytes, utilization, bpt, blockSize, maxModelLen) {
    if (!(utilization > 0 && utilization <= 1)) throw new Error("utilization must be in (0, 1], got " + utilization);
    if (weightBytes + activationBytes > gpuBytes) throw new Error("the model does not fit on the GPU");
    var free = Math.max(0, Math.floor(gpuBytes * utilization) - weightBytes - activationBytes);
    var numBlocks = Math.floor(free / (bpt * blockSize));
    return {
      numBlocks: numBlocks,
      numTokens: numBlocks * blockSize,
      kvBytes: numBlocks * blockSize * bpt,
      numMaxLenSeqs: Math.floor(numBlocks / Math.ceil(maxModelLen / blockSize)),
    };
  }

  function mount(root) {
    var field = function (name) { return root.querySelector('[name="' + name + '"]'); };
    var out = root.querySelector("output");
    function update() {
      var num = function (name) { return Number(field(name).value); };
      try {
        var bpt = bytesPerToken(num("layers"), num("kv_heads"), num("head_dim"), num("dtype_bytes"), num("tp"));
        var plan = planKVPool(Math.floor(num("gpu_gib") * GIB), Math.floor(num("weights_gib") * GIB), 0,
                              num("utilization"), bpt, 256, num("context"));
        out.dataset.bytesPerToken = bpt;
        out.dataset.numTokens = plan.numTokens;
        out.dataset.numSeqs = plan.numMaxLenSeqs;
        out.textContent = bpt.toLocaleString("en-US") + " bytes per token (" + (bpt / 1024).toFixed(1) +
          " KiB); the pool holds " + plan.numBlocks.toLocaleString("en-US") + " blocks of 256 = " +
          plan.numTokens.toLocaleString("en-US") + " tokens, " + plan.numMaxLenSeqs.toLocaleString("en-US") +
          " sequences of " + num("context").toLocaleString("en-US") + " tokens at once";
      } catch (e) {
        out.dataset.bytesPerToken = out.dataset.numTokens = out.dataset.numSeqs = "";
        out.textContent = e.message;
      }
    }
    root.addEventListener("input", update);
    update();
  }

  var api = { bytesPerToken: bytesPerToken, planKVPool: planKVPool };
  if (typeof module !== "undefined" && module.exports) module.exports = api;
  if (typeof document !== "undefined") {
    var start = function () { document.querySelectorAll(".sim-kv-pool").forEach(mount); };
    if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start); else start();
  }
})();
