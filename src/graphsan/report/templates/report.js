// Optional conveniences; the page reads the same without them.
(function () {
  "use strict";
  var toolbar = document.getElementById("toolbar");
  if (!toolbar) { return; }
  toolbar.hidden = false;
  function applyFilter() {
    var shown = {};
    document.querySelectorAll(".kind-filter").forEach(function (box) {
      shown[box.value] = box.checked;
    });
    document.querySelectorAll(".finding, .finding-row").forEach(function (el) {
      el.classList.toggle("hidden", !shown[el.getAttribute("data-kind")]);
    });
  }
  document.querySelectorAll(".kind-filter").forEach(function (box) {
    box.addEventListener("change", applyFilter);
  });
  function setStacks(open) {
    document.querySelectorAll("details.stack").forEach(function (d) { d.open = open; });
  }
  document.getElementById("open-stacks").addEventListener("click", function () { setStacks(true); });
  document.getElementById("close-stacks").addEventListener("click", function () { setStacks(false); });
  // a link to a finding (from the summary or the timeline) opens its stacks; a link to a
  // graph's node list opens it
  function openTarget() {
    var id = decodeURIComponent(location.hash.slice(1));
    var el = id && document.getElementById(id);
    if (el && el.tagName === "DETAILS") { el.open = true; }
    if (el) { el.querySelectorAll("details.stack").forEach(function (d) { d.open = true; }); }
  }
  window.addEventListener("hashchange", openTarget);
  openTarget();
  document.documentElement.setAttribute("data-scripts", "ran");
})();
