// PlotView's front end: one plotly.js for the whole page, and a figure drawn from the model's state.
//
// The model holds the whole figure as JSON (`figure`), never deltas, so a view drawn late, a second view
// of one model, or the views rebuilt after a page reload all draw the same thing from the state alone.
// plotly.js is loaded once per page by a <script> tag from the server extension's route (the same file
// the plotly Python package ships); the browser caches it, so 25 views cost one download.

const LOADING = '__parallelWorkbenchPlotly';

function baseUrl() {
  try {
    const el = document.getElementById('jupyter-config-data');
    if (el) {
      const cfg = JSON.parse(el.textContent || '{}');
      if (cfg.baseUrl) return cfg.baseUrl;
    }
  } catch (e) { /* fall through to the page's base */ }
  return (document.body && document.body.dataset && document.body.dataset.baseUrl) || '/';
}

function loadPlotly(src) {
  if (window.Plotly && window.Plotly.react) return Promise.resolve(window.Plotly);
  if (!window[LOADING]) {
    const url = /^(https?:)?\//.test(src) ? src : baseUrl().replace(/\/?$/, '/') + src;
    window[LOADING] = new Promise((resolve, reject) => {
      // plotly.min.js is UMD: where a page has an AMD loader it would register with it instead of
      // setting window.Plotly, so the loader is hidden while the script runs.
      const define = window.define;
      window.define = undefined;
      const s = document.createElement('script');
      s.src = url;
      s.async = true;
      s.onload = () => {
        window.define = define;
        window.Plotly ? resolve(window.Plotly) : reject(new Error(`${url} loaded but defined no Plotly`));
      };
      s.onerror = () => {
        window.define = define;
        window[LOADING] = undefined;  // a later view may retry (e.g. after the server came back)
        reject(new Error(`could not load plotly.js from ${url}: is the parallel_workbench server extension enabled? (jupyter server extension list)`));
      };
      document.head.appendChild(s);
    });
  }
  return window[LOADING];
}

// One draw queue for the page. A live view changes many figures at once; drawn in one frame they make
// one long task (0.6-1.6 s for a dashboard's 7 figures on a loaded 2-core machine) during which no
// click is handled. The queue draws them in order, in as many frames as it takes, starting a new frame
// once a frame has spent FRAME_MS (always at least one figure per frame). A figure queued again before
// it was drawn keeps its place and draws its latest state once. `whenIdle(fn)` calls fn once the queue
// is empty (PagePace echoes then).
const QUEUE = '__parallelWorkbenchDrawQueue';
const FRAME_MS = 12;

function drawQueue() {
  if (!window[QUEUE]) {
    const pending = new Set();
    const idle = [];
    let frame = 0;
    const run = () => {
      frame = 0;
      const start = performance.now();
      for (const job of pending) {
        pending.delete(job);
        try { job(); } catch (e) { console.error('parallel-workbench: a plot failed to draw', e); }
        if (performance.now() - start > FRAME_MS) break;
      }
      if (pending.size) frame = requestAnimationFrame(run);
      else idle.splice(0).forEach((fn) => fn());
    };
    window[QUEUE] = {
      add(job) { pending.add(job); if (!frame) frame = requestAnimationFrame(run); },
      remove(job) { pending.delete(job); },
      whenIdle(fn) { if (pending.size) idle.push(fn); else fn(); },
    };
  }
  return window[QUEUE];
}

function parse(model) {
  try {
    const fig = JSON.parse(model.get('figure') || '{}');
    return { data: fig.data || [], layout: fig.layout || {} };
  } catch (e) {
    return { data: [], layout: {}, error: `the figure's state is not JSON: ${e}` };
  }
}

function size(div, layout) {
  div.style.height = `${layout.height || 450}px`;
  div.style.width = layout.width ? `${layout.width}px` : '100%';
  div.style.maxWidth = '100%';
}

export default {
  render({ model, el }) {
    const div = document.createElement('div');
    div.className = 'pw-plot';
    el.appendChild(div);
    let alive = true;
    let Plotly = null;
    let drawn = false;
    const queue = drawQueue();

    const draw = () => {
      if (!alive || !Plotly) return;
      const { data, layout, error } = parse(model);
      if (error) { div.textContent = error; return; }
      size(div, layout);
      const config = Object.assign({ responsive: !layout.width, displaylogo: false }, model.get('config') || {});
      Plotly.react(div, data, Object.assign({}, layout, { autosize: !layout.width }), config);
      if (!drawn) {  // the first draw made div a plotly graph: it has .on now
        drawn = true;
        div.on('plotly_click', onClick);
        observer.observe(div);
      }
    };
    // Many state changes before the figure's turn draw once.
    const schedule = () => queue.add(draw);

    const onClick = (ev) => {
      const points = (ev.points || []).map((p) => ({
        trace: p.curveNumber, index: p.pointIndex !== undefined ? p.pointIndex : p.pointNumber,
        x: p.x, y: p.y,
      }));
      model.send({ event: 'click', points });
    };

    // A view first laid out hidden (a closed accordion, a background tab) has no width: redraw on resize.
    const observer = new ResizeObserver(() => {
      if (Plotly && div.data && div.clientWidth > 0) Plotly.Plots.resize(div);
    });

    size(div, parse(model).layout);
    loadPlotly(model.get('plotly_src')).then((P) => {
      if (!alive) return;
      Plotly = P;
      queue.add(draw);
    }).catch((err) => {
      div.textContent = String(err.message || err);
      div.className = 'pw-plot pw-plot-error';
    });

    model.on('change:figure', schedule);
    model.on('change:config', schedule);
    return () => {
      alive = false;
      queue.remove(draw);
      observer.disconnect();
      model.off('change:figure', schedule);
      model.off('change:config', schedule);
      if (Plotly) Plotly.purge(div);
    };
  },
};
