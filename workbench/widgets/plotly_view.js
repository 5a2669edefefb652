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
    let frame = 0;
    let Plotly = null;

    const draw = () => {
      frame = 0;
      if (!alive || !Plotly) return;
      const { data, layout, error } = parse(model);
      if (error) { div.textContent = error; return; }
      size(div, layout);
      const config = Object.assign({ responsive: !layout.width, displaylogo: false }, model.get('config') || {});
      Plotly.react(div, data, Object.assign({}, layout, { autosize: !layout.width }), config);
    };
    // Many state changes in one animation frame draw once.
    const schedule = () => { if (!frame) frame = requestAnimationFrame(draw); };

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
      draw();
      div.on('plotly_click', onClick);
      observer.observe(div);
    }).catch((err) => {
      div.textContent = String(err.message || err);
      div.className = 'pw-plot pw-plot-error';
    });

    model.on('change:figure', schedule);
    model.on('change:config', schedule);
    return () => {
      alive = false;
      if (frame) cancelAnimationFrame(frame);
      observer.disconnect();
      model.off('change:figure', schedule);
      model.off('change:config', schedule);
      if (Plotly) Plotly.purge(div);
    };
  },
};
