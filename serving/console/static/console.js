// flywheel console: live pages. A <main data-refresh="N"> is re-fetched every N seconds as an
// HTML fragment rendered (and escaped) by the server, and swapped in while the tab is visible.
(function () {
  "use strict";
  const main = document.getElementById("main");
  if (!main || !main.dataset.refresh) return;
  const every = Math.max(2, parseInt(main.dataset.refresh, 10) || 5) * 1000;
  async function refresh() {
    if (document.visibilityState !== "visible") return;
    const url = new URL(window.location.href);
    url.searchParams.set("fragment", "1");
    try {
      const answer = await fetch(url, { credentials: "same-origin", headers: { "Accept": "text/html" } });
      if (answer.ok) {
        main.innerHTML = await answer.text();
        main.dataset.updated = new Date().toISOString();
      }
    } catch (e) {
      // the gateway restarts or the network blips: keep the last page, try again next time
    }
  }
  setInterval(refresh, every);
})();
