// The one door to the server extension: GET /workbench/api/<endpoint>?<params>, JSON back.
// The server answers sliced and downsampled; errors arrive as HTTP 4xx {"error": "one line"}, and that
// one line is what the tab shows (never a traceback, never an HTML error page).
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

export type Json = any; // eslint-disable-line @typescript-eslint/no-explicit-any

/** An error the tab shows as one line. */
export class WorkbenchError extends Error {}

export type Params = Record<string, string | number | boolean | undefined | null>;

export async function requestAPI(endpoint: string, params: Params = {}): Promise<Json> {
  const settings = ServerConnection.makeSettings();
  const query = Object.entries(params)
    .filter(([, v]) => v !== undefined && v !== null && v !== '')
    .map(([k, v]) => `${encodeURIComponent(k)}=${encodeURIComponent(String(v))}`)
    .join('&');
  const url = URLExt.join(settings.baseUrl, 'workbench', 'api', endpoint) + (query ? `?${query}` : '');
  let response: Response;
  try {
    // 'no-cache', not the default 'no-store': with 'no-store' JupyterLab appends a bare timestamp
    // argument (a cache buster) that plan-load would read as a layout setting. The server answers
    // with Cache-Control: no-store anyway.
    response = await ServerConnection.makeRequest(url, { method: 'GET', cache: 'no-cache' }, settings);
  } catch (err) {
    throw new WorkbenchError(`cannot reach the Jupyter server (${oneLine(String(err))})`);
  }
  const text = await response.text();
  let body: Json = null;
  try {
    body = text ? JSON.parse(text) : null;
  } catch {
    body = null;
  }
  if (!response.ok) {
    if (body && typeof body.error === 'string') {
      throw new WorkbenchError(oneLine(body.error));
    }
    if (response.status === 404) {
      throw new WorkbenchError(
        'the workbench server extension is not answering (404); install the package into the ' +
          "server's environment and restart jupyter lab"
      );
    }
    throw new WorkbenchError(`server error ${response.status} ${response.statusText}`);
  }
  if (body === null) {
    throw new WorkbenchError('the server answered with no JSON');
  }
  return body;
}

export function oneLine(text: string): string {
  const line = text.split('\n').map(s => s.trim()).filter(Boolean).join(' ');
  return line.length > 400 ? line.slice(0, 397) + '...' : line;
}

export function errorText(err: unknown): string {
  if (err instanceof WorkbenchError) {
    return err.message;
  }
  return oneLine(err instanceof Error ? err.message : String(err));
}
