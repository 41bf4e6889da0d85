// millrace console: "select all" for row checkboxes, and action buttons
// enabled only when something is ticked. Every page works without it.
document.addEventListener("DOMContentLoaded", function () {
  document.querySelectorAll("form[data-rows]").forEach(function (form) {
    var all = form.querySelector("input[data-select-all]");
    var boxes = form.querySelectorAll("input[name=id]");
    var buttons = form.querySelectorAll("button[data-needs-rows]");
    function update() {
      var n = 0;
      boxes.forEach(function (b) { if (b.checked) { n++; } });
      buttons.forEach(function (b) { b.disabled = n === 0; });
      if (all) { all.checked = n > 0 && n === boxes.length; }
    }
    if (all) {
      all.addEventListener("change", function () {
        boxes.forEach(function (b) { b.checked = all.checked; });
        update();
      });
    }
    boxes.forEach(function (b) { b.addEventListener("change", update); });
    update();
  });
});
