// The views inside a Workbench tab. Each asks the server extension for one slice at a time and
// renders it with plain DOM/SVG; none holds checkpoint, memory, run or plan logic of its own.
import { Json, WorkbenchError, errorText, requestAPI } from './api';
import { ISeries, asRecords, el, formatBytes, formatValue, gantt, histogram, jsonView, lineChart, table } from './render';

export type Kind = 'checkpoint' | 'memory' | 'run' | 'plan';

/** Runs a JupyterLab command (set by the plugin): the views' buttons reuse the context-menu commands. */
let execute: (command: string, args: Record<string, string>) => void = () => undefined;
export function setCommandRunner(run: typeof execute): void {
  execute = run;
}

function commandButton(label: string, command: string, path: string): HTMLButtonElement {
  const b = el('button', 'jp-Button pw-action', label);
  b.addEventListener('click', () => execute(command, { path }));
  return b;
}

/** What the server calls a thing, mapped onto the four views. */
export function viewKind(kind: string | undefined): Kind | null {
  const k = (kind ?? '').toLowerCase();
  if (/snapshot|memory|timeline|pickle/.test(k)) {
    return 'memory';
  }
  if (/plan/.test(k) && !/load/.test(k)) {
    return 'plan';
  }
  if (/run|events/.test(k)) {
    return 'run';
  }
  if (/checkpoint|safetensors|dcp|torch|state|index|pt|bin/.test(k)) {
    return 'checkpoint';
  }
  return null;
}

/** The one-line error the tab shows in place of a view. */
export function showError(host: HTMLElement, err: unknown): void {
  host.replaceChildren(el('div', 'pw-error', errorText(err)));
}

function scalars(obj: Json): Record<string, Json> {
  const out: Record<string, Json> = {};
  if (obj && typeof obj === 'object' && !Array.isArray(obj)) {
    for (const [k, v] of Object.entries(obj)) {
      if (v === null || typeof v !== 'object' || (Array.isArray(v) && v.every(x => x === null || typeof x !== 'object'))) {
        out[k] = v;
      }
    }
  }
  return out;
}

function summaryTable(obj: Json, skip: string[] = []): HTMLElement {
  const s = scalars(obj);
  const t = el('table', 'pw-table pw-kv pw-summary');
  for (const [k, v] of Object.entries(s)) {
    if (skip.includes(k)) {
      continue;
    }
    const tr = t.insertRow();
    tr.appendChild(el('th', undefined, k));
    const td = tr.insertCell();
    td.textContent = formatValue(v, k);
    td.dataset.key = k;
  }
  return t;
}

// ---------------------------------------------------------------- checkpoint browser

export class CheckpointView {
  constructor(readonly host: HTMLElement, readonly path: string, readonly info: Json) {}

  private offset = 0;
  private readonly limit = 200;
  private filter = '';
  private kind = '';

  async render(): Promise<void> {
    this.host.replaceChildren();
    const summary = el('div', 'pw-summary-box');
    const bar = el('div', 'pw-toolbar');
    const filter = el('input', 'pw-filter');
    filter.placeholder = 'filter keys (substring)';
    const kind = el('select', 'pw-kind');
    for (const k of ['', 'model', 'optimizer', 'master', 'rng', 'extra']) {
      const o = el('option', undefined, k || 'all kinds');
      o.value = k;
      kind.appendChild(o);
    }
    const prev = el('button', 'jp-Button pw-prev', '◀');
    const next = el('button', 'jp-Button pw-next', '▶');
    const where = el('span', 'pw-where');
    bar.append(filter, kind, prev, where, next);
    const actions = el('div', 'pw-toolbar pw-actions');
    actions.append(
      commandButton('Verify checkpoint', 'parallel-workbench:verify', this.path),
      commandButton('Compare with…', 'parallel-workbench:diff', this.path),
      commandButton('Will it load into…', 'parallel-workbench:plan-load', this.path)
    );
    const body = el('div', 'pw-split');
    const keys = el('div', 'pw-keys');
    const detail = el('div', 'pw-detail', 'Select a key to see its statistics and histogram.');
    body.append(keys, detail);
    const shardMap = el('details', 'pw-shard-map');
    this.host.append(summary, actions, bar, body, shardMap);

    let first = true;
    const load = async () => {
      keys.replaceChildren(el('div', 'pw-note', 'loading…'));
      try {
        const m = await requestAPI('checkpoint/manifest', {
          path: this.path,
          offset: this.offset,
          limit: this.limit,
          filter: this.filter,
          kind: this.kind
        });
        if (first) {
          first = false;
          summary.replaceChildren(summaryTable(m.summary ?? this.info, ['path']));
          if (m.summary?.bytes_by_kind) {
            summary.appendChild(table([m.summary.bytes_by_kind], undefined, undefined, Object.keys(m.summary.bytes_by_kind)));
          }
          if (Array.isArray(m.shard_map) && m.shard_map.length) {
            shardMap.replaceChildren(
              el('summary', undefined, `shard map: ${m.shard_map.length} files`),
              table(asRecords(m.shard_map), ['file', 'rank', 'chunks', 'bytes'], undefined, ['bytes'])
            );
          }
        }
        const rows = asRecords(m.rows);
        const total = Number(m.total ?? rows.length);
        where.textContent = `${total ? this.offset + 1 : 0}–${this.offset + rows.length} of ${total}`;
        prev.disabled = this.offset === 0;
        next.disabled = this.offset + rows.length >= total;
        keys.replaceChildren(
          table(rows, ['key', 'dtype', 'shape', 'kind', 'bytes', 'n_shards'], (row, tr) => {
            keys.querySelectorAll('tr.pw-selected').forEach(n => n.classList.remove('pw-selected'));
            tr.classList.add('pw-selected');
            void this.showTensor(detail, row);
          })
        );
      } catch (err) {
        showError(keys, err);
      }
    };
    let timer: number | undefined;
    filter.addEventListener('input', () => {
      window.clearTimeout(timer);
      timer = window.setTimeout(() => {
        this.filter = filter.value;
        this.offset = 0;
        void load();
      }, 250);
    });
    kind.addEventListener('change', () => {
      this.kind = kind.value;
      this.offset = 0;
      void load();
    });
    prev.addEventListener('click', () => {
      this.offset = Math.max(0, this.offset - this.limit);
      void load();
    });
    next.addEventListener('click', () => {
      this.offset += this.limit;
      void load();
    });
    await load();
  }

  private async showTensor(detail: HTMLElement, row: Record<string, Json>): Promise<void> {
    const key = String(row.key);
    detail.replaceChildren(el('h3', 'pw-key', key), el('div', 'pw-note', 'reading…'));
    try {
      const t = await requestAPI('checkpoint/tensor', { path: this.path, key, bins: 64 });
      detail.replaceChildren(el('h3', 'pw-key', key), summaryTable(t, ['path', 'key']));
      const h = t.histogram;
      if (h && Array.isArray(h.counts) && Array.isArray(h.centers) && h.centers.length) {
        const w = Number(h.width ?? 0);
        const centers = h.centers.map(Number);
        const edges = [...centers.map((c: number) => c - w / 2), centers[centers.length - 1] + w / 2];
        detail.appendChild(histogram(edges, h.counts.map(Number), `histogram of ${key}`));
      }
      if (Array.isArray(row.shards) && row.shards.length) {
        detail.append(el('h4', undefined, `shards (${row.n_shards ?? row.shards.length})`), table(asRecords(row.shards)));
      }
    } catch (err) {
      detail.replaceChildren(el('h3', 'pw-key', key), el('div', 'pw-error', errorText(err)));
    }
  }
}

// ---------------------------------------------------------------- memory timeline

export class MemoryView {
  constructor(readonly host: HTMLElement, readonly path: string, readonly info: Json) {}

  /** While a large snapshot is read (in the server's background), each answer says how far it is and
   * shows the part read so far; the full timeline replaces it. */
  async render(window?: [number, number]): Promise<void> {
    if (!this.host.childElementCount) {
      this.host.appendChild(el('div', 'pw-note', 'reading the snapshot and downsampling…'));
    }
    let tl: Json;
    try {
      let wait = 300; // the first answer comes quickly, so the progress shows from the start
      for (;;) {
        tl = await requestAPI('memory/timeline', { path: this.path, t0: window?.[0], t1: window?.[1], points: 1000, wait });
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
      showError(this.host, err);
      return;
    }
    const ranks: Json[] = tl.per_rank ?? [];
    const series: ISeries[] = ranks.map(r => ({
      name: `rank ${r.rank} total`,
      x: (r.t ?? []).map(Number),
      y: (r.total_bytes ?? []).map(Number)
    }));
    if (ranks.length === 1) {
      for (const [name, ys] of Object.entries(ranks[0].categories ?? {})) {
        series.push({ name, x: series[0].x, y: (ys as Json[]).map(Number) });
      }
    }
    const peaks = ranks.map(r => ({
      rank: r.rank,
      peak_bytes: r.peak?.bytes,
      't (s)': r.peak?.t,
      step: r.peak?.step,
      phase: r.peak?.phase,
      window_peak_bytes: r.window_peak?.bytes,
      events: r.events,
      events_in_window: r.events_in_window
    }));
    const bar = el('div', 'pw-toolbar');
    const reset = el('button', 'jp-Button pw-reset', 'Whole timeline');
    reset.disabled = !window;
    reset.addEventListener('click', () => void this.render());
    const shown = tl.window ?? tl.t_range ?? [];
    bar.append(
      reset,
      el('span', 'pw-note', `window ${shown.map((x: number) => Number(x).toPrecision(5)).join(' – ')} s; drag across the plot to zoom`)
    );
    this.host.replaceChildren(
      summaryTable(tl, ['path', 'window', 'points', 'complete']),
      table(peaks),
      bar,
      lineChart(series, {
        title: 'allocated bytes',
        xLabel: 't (s)',
        yFormat: formatBytes,
        onSelect: (a, b) => void this.render([a, b])
      })
    );
    for (const r of ranks) {
      if (r.peak?.by_category) {
        this.host.append(el('h4', undefined, `rank ${r.rank} at peak, by category`), table([r.peak.by_category], undefined, undefined, Object.keys(r.peak.by_category)));
      }
      if (Array.isArray(r.peak?.alive) && r.peak.alive.length) {
        this.host.append(el('h4', undefined, `rank ${r.rank}: largest blocks alive at peak`), table(asRecords(r.peak.alive)));
      }
    }
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
      y: (r.delta_bytes ?? []).map(Number)
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
          yFormat: formatBytes
        })
      );
    }
    this.host.replaceChildren(box);
  }
}

// ---------------------------------------------------------------- run replay

export class RunView {
  constructor(readonly host: HTMLElement, readonly path: string, readonly info: Json) {}

  private since = 0;
  private pipelineStep: number | undefined;
  private lastSteps: Json[] = [];
  private errors: Json[] = [];
  private timer: number | undefined;

  dispose(): void {
    window.clearTimeout(this.timer);
  }

  async render(): Promise<void> {
    let r: Json;
    try {
      r = await requestAPI('run/events', {
        path: this.path,
        since: this.since,
        types: 'step,error,checkpoint',
        limit: 5000,
        points: 1000
      });
    } catch (err) {
      showError(this.host, err);
      return;
    }
    const events: Json[] = r.events ?? [];
    this.lastSteps = [...this.lastSteps, ...events.filter(e => e.type === 'step')].slice(-50);
    this.errors.push(...events.filter(e => e.type === 'error'));
    this.since = Number(r.next ?? this.since);
    this.draw(r);
    if (r.status === 'running' && this.host.isConnected) {
      this.timer = window.setTimeout(() => void this.render(), 2000);
    }
  }

  private draw(r: Json): void {
    const series = Object.entries(r.series ?? {}) as [string, Json][];
    const per = (field: string): ISeries[] =>
      series.map(([rank, s]) => ({ name: `rank ${rank}`, x: (s.step ?? []).map(Number), y: (s[field] ?? []).map(Number) }));
    const bar = el('div', 'pw-toolbar');
    const refresh = el('button', 'jp-Button pw-refresh', 'Refresh');
    refresh.addEventListener('click', () => void this.render());
    bar.append(refresh, el('span', 'pw-status', `status: ${r.status ?? 'unknown'}, ${r.total ?? this.since} events`));
    this.host.replaceChildren(summaryTable(r.summary ?? {}), bar);
    for (const e of this.errors) {
      const lines = String(e.traceback ?? e.message ?? '').trim().split('\n');
      this.host.appendChild(el('div', 'pw-error', `rank ${e.rank}: ${lines[lines.length - 1]}`));
    }
    // JupyterLab's file browser cannot enter a folder named "checkpoints" (jupyter_server routes
    // /api/contents/<path>/checkpoints to its own checkpoints API), so the run view opens them: the server
    // lists the step directories on disk and those the run's checkpoint events name.
    const ckpts: Json[] = Array.isArray(r.checkpoints) ? r.checkpoints : [];
    if (ckpts.length) {
      const row = el('div', 'pw-toolbar pw-checkpoints');
      row.appendChild(el('span', 'pw-note', 'checkpoints:'));
      for (const c of ckpts) {
        const label = c.step === null || c.step === undefined ? String(c.path).split('/').pop() ?? '' : `step ${c.step}`;
        const b = commandButton(c.latest ? `${label} (latest)` : label, 'parallel-workbench:open', String(c.path));
        b.title = String(c.path);
        row.appendChild(b);
      }
      this.host.appendChild(row);
    }
    this.host.append(
      lineChart(per('loss'), { title: 'loss', xLabel: 'step' }),
      lineChart(per('tokens_per_s'), { title: 'throughput (tokens/s)', xLabel: 'step' })
    );
    if (r.summary?.pipeline) {
      const box = el('div', 'pw-pipeline', 'reading the pipeline schedule…');
      this.host.appendChild(box);
      void this.drawPipeline(box, this.pipelineStep);
    }
    this.host.append(
      el('h4', undefined, 'last steps'),
      table(this.lastSteps, ['rank', 'step', 'loss', 'tokens_per_s', 'step_time_s', 'mem_bytes'])
    );
  }

  /** One pipeline step as stage rows of forward (F) and backward (B) bars, coloured by microbatch, with
   * the measured bubble against the theory; a step picker for the other complete steps. */
  private async drawPipeline(box: HTMLElement, step?: number): Promise<void> {
    let p: Json;
    try {
      p = await requestAPI('run/pipeline', { path: this.path, step });
    } catch (err) {
      box.replaceChildren(el('h4', undefined, 'pipeline timeline'), el('div', 'pw-note', errorText(err)));
      return;
    }
    const rows: Json[] = p.rows ?? [];
    const index = new Map(rows.map((r, i) => [`${r.stage}/${r.rank}`, i]));
    const bars = (p.bars ?? []).map((b: Json) => ({
      row: index.get(`${b.stage}/${b.rank}`) ?? 0,
      start: Number(b.start_ms),
      end: Number(b.end_ms),
      group: Number(b.microbatch),
      label: `${b.phase}${b.microbatch}`,
      light: b.phase === 'B',
      tip: `stage ${b.stage} (rank ${b.rank}), microbatch ${b.microbatch} ${b.phase}: ` +
        `${(Number(b.end_ms) - Number(b.start_ms)).toFixed(2)} ms from ${Number(b.start_ms).toFixed(2)} ms`
    }));
    const pct = (x: Json) => `${Math.round(Number(x) * 100)}%`;
    const bar = el('div', 'pw-toolbar');
    const pick = el('select', 'pw-pipeline-step');
    for (const s of p.steps ?? []) {
      const o = el('option', undefined, `step ${s}`);
      o.value = String(s);
      o.selected = s === p.step;
      pick.appendChild(o);
    }
    pick.addEventListener('change', () => {
      this.pipelineStep = Number(pick.value); // kept while a live run refreshes
      void this.drawPipeline(box, this.pipelineStep);
    });
    const shape = p.stages_per_rank > 1 ? `p=${p.pp}, m=${p.microbatches}, v=${p.stages_per_rank}` : `p=${p.pp}, m=${p.microbatches}`;
    bar.append(
      pick,
      el('span', 'pw-note pw-bubble', `${p.schedule ?? 'pipeline'}, ${shape}: bubble measured ${pct(p.bubble_measured)} vs theory ${pct(p.bubble_theory)}; F solid, B light; colour = microbatch`)
    );
    box.replaceChildren(
      el('h4', undefined, `pipeline timeline, step ${p.step}`),
      bar,
      gantt(rows.map(r => `stage ${r.stage} · rank ${r.rank}`), bars, { xLabel: "ms from the step's first forward" })
    );
  }
}

// ---------------------------------------------------------------- plan table

export class PlanView {
  constructor(readonly host: HTMLElement, readonly path: string, readonly info: Json) {}

  async render(): Promise<void> {
    let p: Json;
    try {
      p = await requestAPI('plan', { path: this.path, offset: 0, limit: 256 });
    } catch (err) {
      showError(this.host, err);
      return;
    }
    const cats: string[] = p.categories ?? ['parameter', 'gradient', 'optimizer', 'master', 'total'];
    this.host.replaceChildren(summaryTable(p, ['path', 'offset', 'limit']));
    if (p.summary) {
      this.host.append(el('h4', undefined, 'summary'), typeof p.summary === 'string' ? el('pre', undefined, p.summary) : jsonView(p.summary));
    }
    if (p.mesh) {
      this.host.append(el('h4', undefined, 'mesh'), table([p.mesh]));
    }
    if (Array.isArray(p.distinct) && p.distinct.length) {
      this.host.append(el('h4', undefined, `bytes per rank (${p.n_distinct ?? p.distinct.length} distinct layouts)`), table(p.distinct, ['ranks', 'count', ...cats], undefined, cats));
    }
    if (Array.isArray(p.rows) && p.rows.length) {
      const rows = p.rows.map((r: Json) => ({ ...r, coords: r.coords ? Object.entries(r.coords).map(([k, v]) => `${k}=${v}`).join(' ') : '' }));
      const box = el('details');
      box.append(el('summary', undefined, `per rank (first ${rows.length} of ${p.world_size ?? rows.length})`), table(rows, ['rank', 'coords', ...cats], undefined, cats));
      this.host.appendChild(box);
    }
    if (Array.isArray(p.comm) && p.comm.length) {
      this.host.append(el('h4', undefined, 'communication per step'), table(asRecords(p.comm)));
    }
    if (Array.isArray(p.notes) && p.notes.length) {
      this.host.append(el('h4', undefined, 'notes'), jsonView(p.notes));
    }
  }
}

// ---------------------------------------------------------------- actions (verify, diff, load dry run)

export async function renderAction(host: HTMLElement, endpoint: string, params: Record<string, string>): Promise<void> {
  host.replaceChildren(el('div', 'pw-note', `running ${endpoint}…`));
  let result: Json;
  try {
    result = await requestAPI(endpoint, params);
  } catch (err) {
    showError(host, err);
    return;
  }
  host.replaceChildren();
  const verdicts: [string, string, string][] = [
    ['ok', 'checkpoint verified: no problems', 'checkpoint has problems'],
    ['identical', 'identical', 'different'],
    ['loadable', 'loads into the target layout', 'will not load into the target layout']
  ];
  for (const [field, yes, no] of verdicts) {
    if (typeof result[field] === 'boolean') {
      host.appendChild(el('div', result[field] ? 'pw-ok pw-verdict' : 'pw-error pw-verdict', result[field] ? yes : no));
    }
  }
  if (result.layout_error) {
    host.appendChild(el('div', 'pw-error', String(result.layout_error)));
  }
  for (const reason of result.reasons ?? []) {
    host.appendChild(el('div', 'pw-error', String(reason)));
  }
  for (const p of result.problems ?? []) {
    host.appendChild(el('div', 'pw-error', String(p.message ?? `${p.file}: ${p.problem}; ${p.fix}`)));
  }
  host.appendChild(jsonView(result));
}

export { WorkbenchError };
