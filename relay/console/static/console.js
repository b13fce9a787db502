// Live figures: every element with data-refresh is fetched again every data-every ms and
// its content replaced by the server's fragment. Nothing else runs on these pages.
for (const el of document.querySelectorAll("[data-refresh]")) {
  const every = Number(el.dataset.every) || 2000;
  const refresh = async () => {
    try {
      const r = await fetch(el.dataset.refresh, { headers: { Accept: "text/html" } });
      if (r.ok) { el.innerHTML = await r.text(); el.classList.remove("stale"); } else { el.classList.add("stale"); }
    } catch (e) { el.classList.add("stale"); }
    setTimeout(refresh, every);
  };
  setTimeout(refresh, every);
}
