// Polls /status.json every second and draws the replica's recent history with uPlot.
"use strict";
(function () {
  const MiB = 1024 * 1024;
  const COLORS = { blue: "#1f77b4", orange: "#ff7f0e", green: "#2ca02c", red: "#d62728", purple: "#9467bd" };
  const state = { samples: [], windowS: 300, lastT: null, charts: {}, generation: false };

  function format(value, unit) {
    if (value === null || value === undefined) return "–";
    switch (unit) {
      case "rate": return value.toFixed(1);
      case "ms": return value.toFixed(1) + " ms";
      case "mean": return value.toFixed(1);
      case "percent": return (value * 100).toFixed(1) + " %";
      case "bytes":
        return (value / MiB).toLocaleString("en-US", { minimumFractionDigits: 1, maximumFractionDigits: 1 }) + " MiB";
      default: return String(Math.round(value));
    }
  }

  function column(field, scale) {
    return state.samples.map((s) => (s[field] === null ? null : s[field] * (scale || 1)));
  }

  // A y axis as wide as its widest tick number (uPlot's default is a fixed 50 px), so the
  // axis label beside the numbers never overlaps them: free memory reads "21,560.5".
  // Measured in every sizing cycle, not only the first: the numbers drawn are those of the
  // last cycle, and a y axis's width never changes its own numbers, so this converges.
  function axisSize(self, values, axisIdx) {
    const axis = self.axes[axisIdx];
    let widest = 0;
    if (values && values.length) {
      self.ctx.font = axis.font[0];
      for (const value of values) widest = Math.max(widest, self.ctx.measureText(String(value)).width);
    }
    return Math.ceil(axis.ticks.size + axis.gap + widest / devicePixelRatio);
  }

  // The x axis's labels: one line each, as wide as "00:00:00" at most, with the detail the tick
  // spacing needs; with ticks an hour or more apart, midnight's names the new day. uPlot's
  // default adds the date (and the hour) under a tick where a new day (or hour) begins, a
  // second line wide enough to run into its neighbour when the change falls just after the
  // first tick.
  const pad2 = (n) => String(n).padStart(2, "0");
  const MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];

  const clockTime = (d) => pad2(d.getHours()) + ":" + pad2(d.getMinutes()) + ":" + pad2(d.getSeconds());

  function timeLabels(self, splits, axisIdx, foundSpace, foundIncr) {
    return splits.map((t) => {
      const d = new Date(t * 1000);
      const hm = pad2(d.getHours()) + ":" + pad2(d.getMinutes());
      if (foundIncr < 60) return clockTime(d);
      const midnight = d.getHours() === 0 && d.getMinutes() === 0;
      if (foundIncr < 3600 || (foundIncr < 86400 && !midnight)) return hm;
      return MONTHS[d.getMonth()] + " " + d.getDate();  // a day's first tick names the day
    });
  }

  // Room for the widest label of timeLabels, with a gap between neighbours.
  function timeSpace(self, axisIdx) {
    self.ctx.font = self.axes[axisIdx].font[0];
    return Math.ceil(self.ctx.measureText("00:00:00").width / devicePixelRatio) + 24;
  }

  function makeChart(id, title, series, axes) {
    const el = document.getElementById(id);
    const opts = {
      title: title,
      width: Math.max(320, el.clientWidth - 8),
      height: 220,
      scales: { x: { time: true } },
      series: [{}].concat(series.map((s) => ({
        label: s.label, stroke: s.color, width: 2, scale: s.scale, spanGaps: false,
        points: { show: false },
      }))),
      axes: [{ values: timeLabels, space: timeSpace }]
        .concat(axes.map((axis) => Object.assign({ size: axisSize }, axis))),
      // uPlot's automatic padding is 0 above the plot while every y axis is hidden (no data in
      // the window) and 17 px once one shows: a plot whose height changes while uPlot sizes
      // the axes can end up drawing numbers wider than the space the axis was laid out with.
      padding: [17, null, 0, null],
      legend: { live: false },
    };
    const chart = new uPlot(opts, [[]].concat(series.map(() => [])), el);
    chart.batchfitSeries = series;
    return chart;
  }

  function createCharts() {
    state.charts.requests = makeChart("chart-requests", "Requests", [
      { field: "requests_per_s", label: "requests/s", color: COLORS.blue, scale: "rate" },
      { field: "latency_p50_ms", label: "p50 ms", color: COLORS.green, scale: "ms" },
      { field: "latency_p99_ms", label: "p99 ms", color: COLORS.red, scale: "ms" },
    ], [{ scale: "rate", label: "requests/s" }, { scale: "ms", side: 1, label: "ms", grid: { show: false } }]);
    state.charts.queue = makeChart("chart-queue", "Queue depth", [
      { field: "queue_depth", label: "items waiting", color: COLORS.purple, scale: "items" },
    ], [{ scale: "items", label: "items" }]);
    state.charts.batches = makeChart("chart-batches", "Batches", [
      { field: "batch_size", label: "mean batch size", color: COLORS.blue, scale: "items" },
      { field: "padded_tokens", label: "padded tokens / batch", color: COLORS.orange, scale: "tokens" },
    ], [{ scale: "items", label: "items" }, { scale: "tokens", side: 1, label: "tokens", grid: { show: false } }]);
    state.charts.memory = makeChart("chart-memory", "Memory (MiB)", [
      { field: "budget_bytes", label: "batch budget", color: COLORS.blue, scale: "mib", factor: 1 / MiB },
      { field: "predicted_peak_bytes", label: "predicted peak", color: COLORS.orange, scale: "mib", factor: 1 / MiB },
      { field: "measured_peak_bytes", label: "measured peak", color: COLORS.red, scale: "mib", factor: 1 / MiB },
      { field: "memory_free_bytes", label: "free", color: COLORS.green, scale: "free", factor: 1 / MiB },
    ], [{ scale: "mib", label: "batch MiB" }, { scale: "free", side: 1, label: "free MiB", grid: { show: false } }]);
  }

  // Drawn only for a replica that serves a generator: one without has no empty charts.
  function createGenerationCharts() {
    state.charts.generationTokens = makeChart("chart-generation-tokens", "Generation: tokens/s", [
      { field: "generated_tokens_per_s", label: "generated/s", color: COLORS.blue, scale: "rate" },
      { field: "prompt_tokens_per_s", label: "prompt/s", color: COLORS.orange, scale: "rate" },
    ], [{ scale: "rate", label: "tokens/s" }]);
    state.charts.generationLatency = makeChart("chart-generation-latency", "First token and between tokens (over the window)", [
      { field: "ttft_p50_ms", label: "first p50 ms", color: COLORS.blue, scale: "first" },
      { field: "ttft_p99_ms", label: "first p99 ms", color: COLORS.red, scale: "first" },
      { field: "tbt_p50_ms", label: "between p50 ms", color: COLORS.green, scale: "between" },
      { field: "tbt_p99_ms", label: "between p99 ms", color: COLORS.purple, scale: "between" },
    ], [{ scale: "first", label: "first token ms" }, { scale: "between", side: 1, label: "between ms", grid: { show: false } }]);
    state.charts.generationSequences = makeChart("chart-generation-sequences", "Sequences", [
      { field: "running_sequences", label: "running", color: COLORS.blue, scale: "seqs" },
      { field: "waiting_sequences", label: "waiting", color: COLORS.orange, scale: "seqs" },
    ], [{ scale: "seqs", label: "sequences" }]);
    state.charts.generationCache = makeChart("chart-generation-cache", "Key/value cache (MiB)", [
      { field: "kv_cache_bytes", label: "held", color: COLORS.blue, scale: "mib", factor: 1 / MiB },
      { field: "kv_cache_budget_bytes", label: "budget", color: COLORS.orange, scale: "mib", factor: 1 / MiB },
    ], [{ scale: "mib", label: "MiB" }]);
  }

  function showGeneration(body) {
    document.getElementById("generation-window").textContent = String(body.window_s);
    if (state.generation || !(body.generators && body.generators.length)) return;
    state.generation = true;
    document.getElementById("generation").hidden = false;  // before the charts measure it
    createGenerationCharts();
  }

  function redraw() {
    const xs = state.samples.map((s) => s.t);
    for (const chart of Object.values(state.charts)) {
      chart.setData([xs].concat(chart.batchfitSeries.map((s) => column(s.field, s.factor))));
    }
  }

  function showSummary(body) {
    const last = state.samples[state.samples.length - 1];
    const summary = document.getElementById("summary");
    if (last) {
      for (const el of document.querySelectorAll("#summary .value, #generation-summary .value")) {
        const value = last[el.id];
        el.dataset.value = value === null || value === undefined ? "" : String(value);
        el.textContent = format(value, el.dataset.unit);
      }
      summary.dataset.t = String(last.t);
      document.getElementById("updated").textContent =
        "updated " + clockTime(new Date(last.t * 1000));
    }
    const stateEl = document.getElementById("state");
    const text = body.draining ? "draining" : body.ready ? "ready" : "not ready";
    stateEl.textContent = text;
    stateEl.className = "state " + (body.ready ? "ready" : "not-ready");
  }

  function showModel(card) {
    if (!card) return;
    document.getElementById("model-name").textContent = card.name;
    const rows = Object.entries(card).map(([key, value]) => {
      const tr = document.createElement("tr");
      const k = document.createElement("td");
      const v = document.createElement("td");
      k.textContent = key;
      v.textContent = value === null ? "–" : key.endsWith("_bytes") ? format(value, "bytes") : String(value);
      tr.append(k, v);
      return tr;
    });
    document.querySelector("#model-card tbody").replaceChildren(...rows);
  }

  async function poll() {
    const url = new URL("/status.json", location.origin);
    if (state.lastT !== null) url.searchParams.set("since", String(state.lastT));
    try {
      const response = await fetch(url, { cache: "no-store", credentials: "same-origin" });
      if (!response.ok) throw new Error("status.json answered " + response.status);
      const body = await response.json();
      state.windowS = body.window_s;
      state.samples = state.samples.concat(body.samples);
      if (state.samples.length) state.lastT = state.samples[state.samples.length - 1].t;
      const oldest = (state.lastT || 0) - state.windowS;
      state.samples = state.samples.filter((s) => s.t > oldest);
      showModel(body.model);
      showGeneration(body);
      showSummary(body);
      redraw();
    } catch (error) {
      const stateEl = document.getElementById("state");
      stateEl.textContent = "unreachable";
      stateEl.className = "state not-ready";
    }
    setTimeout(poll, 1000);
  }

  createCharts();
  window.batchfitStatus = state;
  poll();
})();
