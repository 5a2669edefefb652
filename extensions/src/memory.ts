// The memory tab: the notebook's MemoryTimelineView in plain SVG. Bytes alive per category stacked (the
// core palette's colours, sent by the server), the total on top, phase bands behind, the peak marked and
// annotated, the table of what is alive at the peak, a rank and a step picker, and a saved prediction
// dashed over it. Every number (points, bands, peak, axes) comes from the server's memory/timeline answer,
// which the timeline's own methods compute: this file only draws.
import { Json, errorText, requestAPI } from './api';
import { ISeries, asRecords, attachXBrush, el, formatBytes, lineChart, svg, table } from './render';

const MAX_STEP_OPTIONS = 200; // more steps than this: a number field instead of a menu
let clipIds = 0;

function svgText(attrs: Record<string, string | number>, text: string): SVGElement {
  const t = svg('text', attrs);
  t.textContent = text;
  return t;
}

/** The stacked-area chart of one rank's answer (`per_rank[i]`) in the answer's x window. */
export function memoryChart(
  answer: Json,
  r: Json,
  options: { onSelect?: (x0: number, x1: number) => void; width?: number; height?: number } = {}
): HTMLElement {
  const W = options.width ?? 1040;
  const H = options.height ?? 440;
  const m = { l: 70, r: 20, t: 40, b: 50 };
  const pal = answer.palette ?? {};
  const xa = answer.x_axis;
  const ya = r.y_axis;
  const [x0, x1] = xa.range.map(Number);
  const [y0, y1] = ya.range.map(Number);
  const pw = W - m.l - m.r;
  const ph = H - m.t - m.b;
  const sx = (x: number) => m.l + ((x - x0) / (x1 - x0 || 1)) * pw;
  const sy = (y: number) => m.t + ph - ((y - y0) / (y1 - y0 || 1)) * ph;
  const box = el('div', 'pw-chart pw-memory-chart');
  const root = svg('svg', { viewBox: `0 0 ${W} ${H}`, width: W, height: H, class: 'pw-memory-svg' }) as SVGSVGElement;
  box.appendChild(root);
  const clip = `pw-clip-${++clipIds}`;
  const defs = svg('defs');
  const cp = svg('clipPath', { id: clip });
  cp.appendChild(svg('rect', { x: m.l, y: m.t, width: pw, height: ph }));
  defs.appendChild(cp);
  root.append(defs, svgText({ x: m.l, y: 18, class: 'pw-chart-title' }, String(r.title ?? '')));

  // phase bands, behind everything
  const bands = svg('g', { class: 'pw-bands', 'clip-path': `url(#${clip})` });
  for (const b of r.phases ?? []) {
    const a = sx(Math.max(x0, Number(b.x0)));
    const z = sx(Math.min(x1, Number(b.x1)));
    const rect = svg('rect', {
      x: a,
      y: m.t,
      width: Math.max(0, z - a),
      height: ph,
      fill: String(b.color),
      'fill-opacity': Number(b.opacity),
      class: 'pw-phase-band',
      'data-phase': String(b.phase)
    });
    const tip = svg('title');
    tip.textContent = `${b.phase}, step ${b.step}` + (b.microbatch >= 0 ? `, microbatch ${b.microbatch}` : '');
    rect.appendChild(tip);
    bands.appendChild(rect);
  }
  root.appendChild(bands);

  // grid and ticks: the server's 1-2-5 ticks
  const grid = svg('g', { class: 'pw-grid' });
  (ya.ticks as number[]).forEach((v, i) => {
    const y = sy(Number(v));
    grid.appendChild(svg('line', { x1: m.l, x2: W - m.r, y1: y, y2: y, class: 'pw-gridline' }));
    grid.appendChild(
      svgText({ x: m.l - 6, y: y + 4, 'text-anchor': 'end', class: 'pw-tick pw-ytick', 'data-value': Number(v) }, String(ya.labels[i]))
    );
  });
  (xa.ticks as number[]).forEach((v, i) => {
    const x = sx(Number(v));
    grid.appendChild(svg('line', { x1: x, x2: x, y1: m.t, y2: m.t + ph, class: 'pw-gridline' }));
    grid.appendChild(
      svgText({ x, y: H - m.b + 16, 'text-anchor': 'middle', class: 'pw-tick pw-xtick', 'data-value': Number(v) }, String(xa.labels[i]))
    );
  });
  root.appendChild(grid);

  // the stacked categories, bottom first, as the notebook's plotly stackgroup draws them
  const xs: number[] = (r.x ?? []).map(Number);
  const data = svg('g', { class: 'pw-data', 'clip-path': `url(#${clip})` });
  const below = xs.map(() => 0);
  for (const cat of r.stack ?? []) {
    const ys: number[] = (r.categories?.[cat] ?? []).map(Number);
    const above = below.map((b, i) => b + (ys[i] ?? 0));
    const upper = xs.map((x, i) => `${sx(x).toFixed(1)},${sy(above[i]).toFixed(1)}`);
    const lower = xs.map((x, i) => `${sx(x).toFixed(1)},${sy(below[i]).toFixed(1)}`).reverse();
    const color = String(pal.categories?.[cat] ?? '#7f7f7f');
    // No stroke and no anti-aliasing: a downsampled timeline is a few thousand spikes (each bin's minimum
    // and maximum), and anti-aliased filling of such a path held Chromium's main thread for 0.7-3 s
    // (measured: 6 areas of 2000 points); crisp edges draw it in tens of ms, and the total line on top
    // stays smooth.
    const area = svg('path', {
      d: xs.length ? `M${upper.join('L')}L${lower.join('L')}Z` : '',
      fill: color,
      'shape-rendering': 'crispEdges',
      class: 'pw-area',
      'data-category': cat
    });
    const tip = svg('title');
    tip.textContent = cat;
    area.appendChild(tip);
    data.appendChild(area);
    above.forEach((v, i) => (below[i] = v));
  }
  const line = (xv: number[], yv: number[]) =>
    xv.map((x, i) => `${sx(x).toFixed(1)},${sy(yv[i]).toFixed(1)}`).join(' ');
  data.appendChild(
    svg('polyline', { points: line(xs, (r.total_bytes ?? []).map(Number)), class: 'pw-total', stroke: String(pal.total), fill: 'none' })
  );
  if (r.overlay) {
    data.appendChild(
      svg('polyline', {
        points: line(r.overlay.x.map(Number), r.overlay.total_bytes.map(Number)),
        class: 'pw-overlay',
        stroke: String(pal.overlay),
        fill: 'none',
        'stroke-dasharray': '6 4'
      })
    );
  }
  root.appendChild(data);

  // axes and their titles
  root.appendChild(svg('line', { x1: m.l, y1: m.t + ph, x2: W - m.r, y2: m.t + ph, class: 'pw-axis' }));
  root.appendChild(svg('line', { x1: m.l, y1: m.t, x2: m.l, y2: m.t + ph, class: 'pw-axis' }));
  root.appendChild(svgText({ x: m.l + pw / 2, y: H - 10, 'text-anchor': 'middle', class: 'pw-axis-title pw-xtitle' }, String(xa.title ?? '')));
  root.appendChild(
    svgText(
      { x: 16, y: m.t + ph / 2, 'text-anchor': 'middle', transform: `rotate(-90 16 ${m.t + ph / 2})`, class: 'pw-axis-title pw-ytitle' },
      String(ya.unit)
    )
  );

  // the peak: an x and its annotation (bytes; phase, step, microbatch)
  const p = r.marker;
  if (p && Number(p.x) >= x0 && Number(p.x) <= x1) {
    const px = sx(Number(p.x));
    const py = sy(Number(p.bytes));
    const g = svg('g', { class: 'pw-peak', 'data-bytes': Number(p.bytes), 'data-kind': String(p.kind) });
    const s = 5;
    g.appendChild(svg('path', { d: `M${px - s},${py - s}L${px + s},${py + s}M${px - s},${py + s}L${px + s},${py - s}`, stroke: String(pal.peak), 'stroke-width': 2 }));
    const lx = Math.min(px + 14, W - m.r - 180);
    const ly = Math.max(m.t + 4, py - 34);
    g.appendChild(svg('line', { x1: px, y1: py, x2: lx, y2: ly + 14, stroke: String(pal.peak), 'stroke-width': 0.8 }));
    g.appendChild(svg('rect', { x: lx, y: ly, width: 176, height: 32, class: 'pw-peak-box' }));
    (p.label as string[]).forEach((text, i) => {
      g.appendChild(svgText({ x: lx + 6, y: ly + 13 + i * 14, class: i ? 'pw-peak-label' : 'pw-peak-label pw-peak-bytes' }, text));
    });
    root.appendChild(g);
  }

  // legend: the categories drawn, the total, the overlay, the phases present
  const legend = el('div', 'pw-legend-box pw-memory-legend');
  const item = (label: string, color: string, cls: string, dashed = false) => {
    const it = el('span', `pw-legend-entry ${cls}`);
    const sw = el('span', 'pw-swatch');
    sw.style.background = dashed ? 'transparent' : color;
    sw.style.borderTop = dashed ? `2px dashed ${color}` : '';
    it.append(sw, document.createTextNode(label));
    legend.appendChild(it);
  };
  legend.appendChild(el('span', 'pw-legend-group', 'bytes alive:'));
  for (const cat of r.stack ?? []) {
    item(cat, String(pal.categories?.[cat]), 'pw-legend-category');
  }
  item('total', String(pal.total), 'pw-legend-total');
  if (r.overlay) {
    item(`${r.overlay.source} total (rank ${r.overlay.rank})`, String(pal.overlay), 'pw-legend-overlay', true);
  }
  const phases = Array.from(new Set((r.phases ?? []).map((b: Json) => String(b.phase)))) as string[];
  if (phases.length) {
    legend.appendChild(el('span', 'pw-legend-group', 'phase:'));
  }
  for (const ph of phases) {
    item(ph, String(pal.phases?.[ph]), 'pw-legend-phase');
  }
  box.appendChild(legend);

  if (options.onSelect) {
    // Drag across the plot to zoom into that x window (the server re-downsamples it).
    attachXBrush(root, W, m, ph, [x0, x1], sx, options.onSelect);
  }
  return box;
}

/** "Alive at rank r's peak": its bytes by category (palette swatches), the largest allocations and the
 * modules that made them, as the notebook view's table. */
function aliveTables(r: Json, pal: Json): HTMLElement {
  const p = r.peak ?? {};
  const box = el('div', 'pw-alive');
  const head = el('div', 'pw-alive-head');
  head.append(el('b', undefined, `Alive at rank ${r.rank}'s peak`), document.createTextNode(`: ${formatBytes(Number(p.bytes))} (${p.phase}, step ${p.step}) = `));
  Object.entries(p.by_category ?? {}).forEach(([cat, b], i) => {
    if (i) {
      head.appendChild(document.createTextNode(' · '));
    }
    // a drawn swatch, not a "■" glyph: a glyph outside the UI font sends Chromium to fontconfig for a
    // fallback font, which took 1-2 s of the main thread on a fresh browser here
    const sw = el('span', 'pw-swatch');
    sw.style.background = String(pal.categories?.[cat] ?? '');
    head.append(sw, document.createTextNode(` ${cat} ${formatBytes(Number(b))}`));
  });
  const tables = el('div', 'pw-alive-tables');
  const alive = asRecords(p.alive ?? []).map(a => ({ bytes: a.bytes, category: a.category, module: a.module || '-', op: a.op, 'made in': a.phase }));
  const mods = asRecords(p.modules ?? []).map(a => ({ module: a.module || '(outside any module)', bytes: a.bytes, allocations: a.count }));
  const left = el('div');
  left.append(el('div', 'pw-caption', 'largest allocations'), table(alive, ['bytes', 'category', 'module', 'op', 'made in'], undefined, ['bytes']));
  const right = el('div');
  right.append(el('div', 'pw-caption', 'by module'), table(mods, ['module', 'bytes', 'allocations'], undefined, ['bytes']));
  tables.append(left, right);
  box.append(head, tables);
  return box;
}

export class MemoryView {
  constructor(readonly host: HTMLElement, readonly path: string, readonly info: Json) {}

  private rank: number | null = null; // null: the rank with the largest peak (the notebook's first)
  private step: number | null = null;
  private window: [number, number] | null = null;
  private overlay = '';
  private timer: number | undefined;
  /** The choices of the view on screen (rank, step, window, overlay), restored when a new one is refused. */
  private shown: [number | null, number | null, [number, number] | null, string] | null = null;

  /** While a large snapshot is read (in the server's background), each answer says how far it is and
   * shows the part read so far; the full timeline replaces it. */
  async render(): Promise<void> {
    window.clearTimeout(this.timer);
    if (!this.host.childElementCount) {
      this.host.appendChild(el('div', 'pw-note', 'reading the snapshot and downsampling…'));
    }
    let tl: Json;
    try {
      let wait = 300; // the first answer comes quickly, so the progress shows from the start
      for (;;) {
        tl = await requestAPI('memory/timeline', {
          path: this.path,
          rank: this.rank ?? 'peak',
          step: this.step,
          t0: this.window?.[0],
          t1: this.window?.[1],
          overlay: this.overlay,
          points: 2000,
          wait
        });
        if (tl.complete !== false) {
          break;
        }
        if (!this.host.isConnected) {
          return; // the tab was closed
        }
        this.drawProgress(tl.progress ?? {});
        wait = 1000;
      }
    } catch (err) {
      this.drawError(err);
      return;
    }
    if (tl.overlay && tl.overlay.complete === false && this.host.isConnected) {
      this.timer = window.setTimeout(() => void this.render(), 1000); // the overlay is still being read
    }
    this.draw(tl);
  }

  private drawError(err: unknown): void {
    // a choice the server refuses (an overlay that is no timeline, a typed step it lacks) is undone and the
    // tab says why above the view it keeps; with no view yet, the error is the tab
    const chart = this.host.querySelector('.pw-memory-chart');
    if (chart && this.shown) {
      [this.rank, this.step, this.window, this.overlay] = this.shown;
      const note = this.host.querySelector('.pw-choice-error') ?? this.host.insertBefore(el('div', 'pw-error pw-choice-error'), chart);
      note.textContent = errorText(err);
      return;
    }
    this.host.replaceChildren(el('div', 'pw-error', errorText(err)));
  }

  private draw(tl: Json): void {
    const r: Json = (tl.per_rank ?? [])[0];
    const pal = tl.palette ?? {};
    const peaks: Json[] = tl.peaks ?? [];
    const top = peaks.reduce((a: Json, p: Json) => (a === null || p.bytes > a.bytes ? p : a), null);
    const head = el(
      'div',
      'pw-memory-head',
      `Memory timeline (${tl.source}, ${tl.device}) · ${(tl.ranks ?? []).length} rank(s) · ${(tl.steps ?? []).length} step(s)` +
        (top ? ` · largest peak ${formatBytes(Number(top.bytes))} on rank ${top.rank}` : '') +
        (tl.overlay?.source ? ` · dashed: ${tl.overlay.source} (${tl.overlay.path}); x axis: ${tl.x === 'step' ? 'step clock' : 'time'}` : '')
    );
    if (!r) {
      this.host.replaceChildren(head, el('div', 'pw-note', 'this timeline has no ranks'));
      return;
    }
    this.rank = Number(r.rank);
    this.shown = [this.rank, this.step, this.window, this.overlay];

    const bar = el('div', 'pw-toolbar');
    const rankPick = el('select', 'pw-rank');
    for (const p of peaks) {
      const o = el('option', undefined, `rank ${p.rank} (peak ${formatBytes(Number(p.bytes))})`);
      o.value = String(p.rank);
      o.selected = Number(p.rank) === this.rank;
      rankPick.appendChild(o);
    }
    rankPick.addEventListener('change', () => {
      this.rank = Number(rankPick.value);
      void this.render();
    });
    const steps: number[] = tl.steps ?? [];
    const pickStep = (value: string) => {
      this.step = value.trim() === '' ? null : Number(value);
      this.window = null; // a step is its own window
      void this.render();
    };
    let stepPick: HTMLElement;
    if (steps.length <= MAX_STEP_OPTIONS) {
      const select = el('select', 'pw-step');
      for (const s of [null, ...steps]) {
        const o = el('option', undefined, s === null ? 'all steps' : `step ${s}`);
        o.value = s === null ? '' : String(s);
        o.selected = s === this.step;
        select.appendChild(o);
      }
      select.addEventListener('change', () => pickStep(select.value));
      stepPick = select;
    } else {
      // thousands of steps (a long snapshot): a menu of them all took Chromium seconds to lay out
      const input = el('input', 'pw-step-input');
      input.type = 'number';
      input.placeholder = `step ${steps[0]}–${steps[steps.length - 1]} (empty: all)`;
      input.value = this.step === null ? '' : String(this.step);
      input.addEventListener('change', () => pickStep(input.value));
      stepPick = input;
    }
    const reset = el('button', 'jp-Button pw-reset', 'Whole timeline');
    reset.disabled = !this.window;
    reset.addEventListener('click', () => {
      this.window = null;
      void this.render();
    });
    const unit = tl.x === 'step' ? ' (step clock)' : ' s';
    const zoom = el('span', 'pw-note pw-zoom', `window ${tl.x_axis.window_label}${unit}; drag across the plot to zoom`);
    const over = el('input', 'pw-overlay-path');
    over.placeholder = 'overlay: a saved prediction (path under the root)';
    over.value = this.overlay;
    const overBtn = el('button', 'jp-Button pw-overlay-button', this.overlay ? 'Change overlay' : 'Overlay');
    overBtn.addEventListener('click', () => {
      this.overlay = over.value.trim();
      this.window = null; // the clock may change (time <-> step clock)
      void this.render();
    });
    bar.append(el('span', 'pw-note', 'rank'), rankPick, stepPick, reset, zoom, over, overBtn);

    const notes = el('div', 'pw-notes');
    if (tl.overlay?.complete === false) {
      notes.appendChild(el('div', 'pw-note', `reading the overlay ${tl.overlay.path}…`));
    } else if (tl.overlay?.source && !r.overlay) {
      notes.appendChild(el('div', 'pw-note', `the ${tl.overlay.source} timeline has nothing for rank ${r.rank}` + (this.step === null ? '' : ` in step ${this.step}`)));
    }
    if (!r.events_in_window) {
      notes.appendChild(el('div', 'pw-note', `rank ${r.rank} has no events` + (this.step === null ? ' in this window' : ` in step ${this.step}`)));
    }
    const peakRows = peaks.map(p => ({ rank: p.rank, peak_bytes: p.bytes, 't (s)': p.t, step: p.step, phase: p.phase }));
    const details = el('details', 'pw-peaks');
    details.open = peaks.length <= 8;
    details.append(el('summary', undefined, `peak per rank (${peaks.length})`), table(peakRows, undefined, undefined, ['peak_bytes']));
    this.host.replaceChildren(
      head,
      bar,
      notes,
      memoryChart(tl, r, {
        onSelect: (a, b) => {
          this.window = [a, b];
          void this.render();
        }
      }),
      aliveTables(r, pal),
      details
    );
  }

  /** The progress bar and the line of the part read: what the server has read is real data, labelled
   * as partial (no base, no categories, no peak until the whole file is read). */
  private drawProgress(pr: Json): void {
    const fraction = typeof pr.fraction === 'number' ? pr.fraction : 0;
    const pct = `${Math.floor(fraction * 100)}%`;
    const stage =
      pr.stage === 'reading'
        ? `${pct} read (${formatBytes(Number(pr.bytes_read ?? 0))} of ${formatBytes(Number(pr.bytes_total ?? 0))})`
        : `${pct} read; ${pr.stage ?? 'finishing'}…`;
    const bar = el('progress', 'pw-progress') as HTMLProgressElement;
    bar.max = 1;
    bar.value = fraction;
    const ranks: Json[] = (pr.per_rank ?? []).filter((r: Json) => !r.several_devices);
    const series: ISeries[] = ranks.map(r => ({
      name: `rank ${r.rank}: allocated − freed since the trace's first event`,
      x: (r.t ?? []).map(Number),
      y: (r.delta_bytes ?? []).map(Number),
      // one rank's line is a total: the palette's total colour, which no category has
      color: ranks.length === 1 ? pr.palette?.total : undefined
    }));
    const box = el('div', 'pw-partial');
    box.append(
      el('div', 'pw-note pw-progress-label', `reading the snapshot: ${stage}, ${Number(pr.elapsed_s ?? 0).toFixed(1)} s`),
      bar
    );
    if (series.some(x => x.x.length)) {
      box.append(
        table(ranks.map(r => ({ rank: r.rank, events_read: r.events_read, max_delta_bytes: r.max_delta_bytes }))),
        lineChart(series, {
          title: `partial: the first ${pct} of the file (no base bytes or categories until it is all read)`,
          xLabel: 't (s)',
          yBytes: true
        })
      );
    }
    this.host.replaceChildren(box);
  }
}
