// Overview: poll /api/overview once a second, redraw the tables, extend the charts.
// Text goes in with textContent only, so names and errors can never become markup.
"use strict";
(function () {
  const WINDOW = 15 * 60, charts = {};
  const bytes = (n) => n == null ? "" : n < 1024 ? n + " B" : n < 1048576 ? (n / 1024).toFixed(1) + " KiB" : (n / 1048576).toFixed(1) + " MiB";
  const cell = (text, cls) => { const td = document.createElement("td"); td.textContent = text == null ? "" : String(text); if (cls) td.className = cls; return td; };
  function serverRows(servers) {
    const body = document.querySelector("#servers tbody"); body.replaceChildren();
    for (const s of servers) {
      const tr = document.createElement("tr"); tr.dataset.server = s.id;
      tr.append(cell(s.name), cell(s.up ? "up" : s.error, s.up ? "up" : "down"), cell(s.version), cell(s.uptime), cell(s.connections));
      for (const k of ["ready", "reserved", "delayed", "buried"]) tr.append(cell(s.jobs[k]));
      tr.append(cell(s.cmd_rate), cell(bytes(s.binlog_bytes)), cell(s.replication, "replication")); body.append(tr);
    }
  }
  function tubeRows(tubes, servers) {
    const body = document.querySelector("#tubes tbody"); body.replaceChildren();
    for (const t of tubes) {
      const tr = document.createElement("tr"); tr.dataset.tube = t.name;
      const a = document.createElement("a"); a.href = "/tube?s=" + t.server + "&t=" + encodeURIComponent(t.name); a.textContent = t.name;
      const name = document.createElement("td"); name.append(a);
      tr.append(cell(servers[t.server].name), name);
      for (const k of ["ready", "reserved", "delayed", "buried", "urgent", "waiting", "paused"]) tr.append(cell(t[k], k));
      tr.append(cell(t.put_rate), cell(t.delete_rate)); body.append(tr);
    }
  }
  function chart(key, label, data) {
    const box = document.createElement("div"); box.className = "chart"; box.dataset.chart = key;
    document.getElementById("charts").append(box);
    const opts = { title: label, width: 380, height: 160, scales: { x: { time: true } },
      series: [{}, { label: "ready", stroke: "#1e88e5" }, { label: "reserved", stroke: "#fb8c00" }, { label: "buried", stroke: "#e53935" }] };
    charts[key] = { data: data, plot: new uPlot(opts, data, box) };
  }
  function extend(tubes, servers, now) {
    for (const t of tubes) {
      const key = t.server + "/" + t.name;
      if (!charts[key]) { if (Object.keys(charts).length >= 24) continue; chart(key, servers[t.server].name + " · " + t.name, [[], [], [], []]); }
      const c = charts[key], d = c.data;
      if (d[0].length && d[0][d[0].length - 1] >= now) continue;
      d[0].push(now); d[1].push(t.ready); d[2].push(t.reserved); d[3].push(t.buried);
      while (d[0].length && d[0][0] < now - WINDOW) for (const s of d) s.shift();
      c.plot.setData(d);
    }
  }
  async function poll(first) {
    try {
      const r = await fetch("/api/overview" + (first ? "?history=1" : ""), { cache: "no-store" });
      const j = await r.json();
      serverRows(j.servers); tubeRows(j.tubes, j.servers);
      if (first && j.history) for (const [sid, tubes] of Object.entries(j.history))
        for (const [name, data] of Object.entries(tubes)) chart(sid + "/" + name, j.servers[sid].name + " · " + name, data);
      if (j.time) extend(j.tubes, j.servers, j.time);
      document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
    } catch (e) {
      document.getElementById("updated").textContent = "dashboard unreachable: " + e;
    }
    setTimeout(poll, 1000, false);
  }
  poll(true);
})();
