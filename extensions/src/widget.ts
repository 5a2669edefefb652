// The Lumino widget of a Workbench tab: asks the server what the path is, then shows the matching view.
import { Widget } from '@lumino/widgets';
import { requestAPI } from './api';
import { el } from './render';
import { MemoryView } from './memory';
import { TimeView } from './time';
import { CheckpointView, Kind, PlanView, RunView, renderAction, showError, viewKind } from './views';

export interface IWorkbenchViewOptions {
  path: string;
  /** The view the file type suggests; the server's answer to `open` wins. */
  hint?: Kind;
  /** An action instead of the view: verify, diff or plan-load with its parameters. */
  action?: { endpoint: string; params: Record<string, string> };
}

export class WorkbenchView extends Widget {
  constructor(readonly options: IWorkbenchViewOptions) {
    super();
    this.addClass('pw-view');
    this.body = el('div', 'pw-body');
    this.node.appendChild(this.body);
    void this.load();
  }

  readonly body: HTMLDivElement;

  private async load(): Promise<void> {
    const { path, action } = this.options;
    if (action) {
      this.body.appendChild(el('h2', 'pw-title', `${action.endpoint.replace('checkpoint/', '')}: ${path}`));
      const host = el('div', 'pw-content');
      this.body.appendChild(host);
      await renderAction(host, action.endpoint, { path, ...action.params });
      return;
    }
    const host = el('div', 'pw-content', 'opening…');
    this.body.append(el('h2', 'pw-title', path), host);
    let info: any; // eslint-disable-line @typescript-eslint/no-explicit-any
    try {
      info = await requestAPI('open', { path });
    } catch (err) {
      showError(host, err);
      return;
    }
    const kind = viewKind(info.view ?? info.kind ?? info.type) ?? this.options.hint ?? null;
    this.node.dataset.kind = kind ?? 'unknown';
    switch (kind) {
      case 'checkpoint':
        return new CheckpointView(host, typeof info.checkpoint === 'string' ? info.checkpoint : path, info).render();
      case 'memory':
        return new MemoryView(host, path, info).render();
      case 'run': {
        const run = new RunView(host, typeof info.run === 'string' ? info.run : path, info);
        this.disposed.connect(() => run.dispose());
        return run.render();
      }
      case 'plan':
        return new PlanView(host, path, info).render();
      case 'time':
        return new TimeView(host, path, info).render();
      default:
        showError(host, new Error(`${path} is not a checkpoint, memory snapshot, run, plan or profiler trace the workbench knows`));
    }
  }
}
